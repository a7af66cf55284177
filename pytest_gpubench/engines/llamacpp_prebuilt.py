"""The prebuilt llama.cpp server: xllamacpp's wheel (llama.cpp's HTTP server compiled in), pinned,
installed once into the cache where this machine can run it, and started through the launcher."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_gpubench.core.cache import CACHE_DIR_ENV, cache_dir
from pytest_gpubench.core.errors import GpubenchError

# The wheel's version is CalVer `YYYY.M.<llama.cpp build number>`: its llama.cpp is b11549.
XLLAMACPP_VERSION = "2026.10.11549"
PACKAGE = "xllamacpp"
# Set to anything but "" or "0": the managed llama.cpp cell runs a llama-server built from source.
BUILD_ENV = "GPUBENCH_LLAMA_SERVER_BUILD"
LAUNCHER_MODULE = "pytest_gpubench.engines.llamacpp_launcher"
INSTALL_TIMEOUT_S = 900.0
CHECK_TIMEOUT_S = 60.0
CPUINFO = Path("/proc/cpuinfo")
# The machines its manylinux x86_64 wheel is built for; it uses AVX2 (no AVX-512).
WHEEL_SYSTEM = "Linux"
WHEEL_MACHINES = ("x86_64", "amd64")
NEEDED_CPU_FLAG = "avx2"

Progress = Callable[[str], None]


def llama_cpp_build(version: str = XLLAMACPP_VERSION) -> str:
    """The llama.cpp build the wheel holds (`b11549`): the last part of its version. The server
    itself answers `b0-unknown` (/props build_info, each stream's system_fingerprint)."""
    return f"b{version.rsplit('.', 1)[-1]}"


def prebuilt_engine_version(version: str = XLLAMACPP_VERSION) -> str:
    """The engine version a cell running the prebuilt server records: the package and its
    llama.cpp build, never the same text as a built llama-server's `b<number>-<commit>`, so a
    baseline of one is `incomparable` with a run of the other (results/baseline.py)."""
    return f"{PACKAGE} {version} (llama.cpp {llama_cpp_build(version)})"


def build_forced(environ: Mapping[str, str] | None = None) -> str | None:
    """`GPUBENCH_LLAMA_SERVER_BUILD=<value>` when it forces the source build, else None."""
    value = (os.environ if environ is None else environ).get(BUILD_ENV, "").strip()
    return None if value in ("", "0") else f"{BUILD_ENV}={value}"


@dataclass(frozen=True)
class MachineFacts:
    """What decides whether the wheel runs here: the OS, the architecture, the CPU's flags
    (None where /proc/cpuinfo could not be read)."""

    system: str
    machine: str
    cpu_flags: frozenset[str] | None

    @classmethod
    def of_this_machine(cls, cpuinfo: Path = CPUINFO) -> MachineFacts:
        return cls(platform.system(), platform.machine(), cpu_flags(cpuinfo))


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The `flags` of the first processor in /proc/cpuinfo; None where there is none to read."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return None


def prebuilt_refusal(facts: MachineFacts) -> str | None:
    """Why the wheel cannot run on this machine, in words; None where it can."""
    if facts.system != WHEEL_SYSTEM:
        return f"the {PACKAGE} wheel pinned here is for Linux; this is {facts.system}"
    if facts.machine.lower() not in WHEEL_MACHINES:
        return f"the {PACKAGE} wheel pinned here is for x86_64; this machine is {facts.machine}"
    if facts.cpu_flags is None:
        return f"{CPUINFO} could not be read, so AVX2 (which the {PACKAGE} wheel needs) is unknown"
    if NEEDED_CPU_FLAG not in facts.cpu_flags:
        return f"this CPU has no AVX2 ({CPUINFO} flags), which the {PACKAGE} wheel needs"
    return None


def prebuilt_reason(facts: MachineFacts) -> str:
    """Why the prebuilt server was chosen, in words (the machine that allows it)."""
    return f"{facts.system} {facts.machine} with AVX2 ({CPUINFO} flags)"


def package_dir(cache_root: Path | None = None, version: str = XLLAMACPP_VERSION) -> Path:
    """`<cache>/xllamacpp/<version>`: the wheel installed with `pip --target`, shared by every
    environment of this machine (as the built llama-server is), left by `make clean`."""
    root = cache_root if cache_root is not None else cache_dir()
    return root / PACKAGE / version


def is_installed(directory: Path, version: str = XLLAMACPP_VERSION) -> bool:
    return (directory / PACKAGE / "__init__.py").is_file() and (
        directory / f"{PACKAGE}-{version}.dist-info"
    ).is_dir()


def installed_version(directory: Path) -> str | None:
    """The version the installed wheel's own metadata states (its dist-info METADATA), None
    where none is installed there: what the engine version is made of, since the server itself
    answers `b0-unknown`."""
    for metadata in sorted(directory.glob(f"{PACKAGE}-*.dist-info/METADATA")):
        try:
            text = metadata.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Version:"):
                return line.partition(":")[2].strip()
            if not line.strip():
                break  # the headers end at the first blank line
    return None


def launcher_command(python: str | None = None) -> list[str]:
    """The argv that starts the prebuilt server, before its llama-server flags."""
    return [python or sys.executable, "-m", LAUNCHER_MODULE]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def install_prebuilt(
    *, progress: Progress | None = None, cache_root: Path | None = None, check: bool = False
) -> Path:
    """The pinned wheel in the cache, installed with pip (binary only: its sdist would need a
    Rust and C++ toolchain) where it is not there yet; `check` starts the launcher once
    (`--version`) to prove the wheel runs on this CPU. Returns its directory."""
    from pytest_gpubench.engines.llamacpp_build import build_lock

    say = progress or _say
    directory = package_dir(cache_root)
    try:
        with build_lock(directory.parent):
            if not is_installed(directory):
                _pip_install(directory, say)
    except OSError as exc:
        raise GpubenchError(f"cannot install {PACKAGE} into {directory}: {exc}") from exc
    if check:
        say(f"{PACKAGE} answers: {check_prebuilt(cache_root)}")
    return directory


def _pip_install(directory: Path, say: Progress) -> None:
    requirement = f"{PACKAGE}=={XLLAMACPP_VERSION}"
    started = time.monotonic()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".install-", dir=directory.parent) as work:
        target = Path(work) / "target"
        argv = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        argv += ["--no-deps", "--only-binary", ":all:", "--target", str(target), requirement]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GpubenchError(f"cannot install {requirement} with pip: {exc}") from None
        if done.returncode != 0 or not is_installed(target):
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise GpubenchError(
                f"cannot install {requirement} with pip: {last} (or set {BUILD_ENV}=1 to build "
                "llama-server from source)"
            )
        # Whole or not at all: a reader never finds half a package.
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(target, directory)
    say(f"installed {requirement} into {directory} in {time.monotonic() - started:.1f} s")


def check_prebuilt(cache_root: Path | None = None) -> str:
    """The launcher's `--version` line: the wheel imported and its llama.cpp loaded on this CPU
    (an `Illegal instruction` here is one line, not a server that dies at its first start)."""
    env = dict(os.environ)
    if cache_root is not None:
        env[CACHE_DIR_ENV] = str(cache_root)
    try:
        done = subprocess.run(
            [*launcher_command(), "--version"],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpubenchError(f"the prebuilt llama.cpp server did not start: {exc}") from None
    lines = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode != 0:
        why = lines[-1] if lines else _exit_reason(done.returncode)
        raise GpubenchError(
            f"the prebuilt llama.cpp server ({PACKAGE} {XLLAMACPP_VERSION}) does not run here: "
            f"{why}; set {BUILD_ENV}=1 to build llama-server from source"
        )
    return lines[0] if lines else ""


def _exit_reason(returncode: int) -> str:
    """`killed by SIGILL (Illegal instruction)` for a signal, else the exit status."""
    if returncode >= 0:
        return f"exit status {returncode}"

    try:
        number = signal.Signals(-returncode)
    except ValueError:
        return f"killed by signal {-returncode}"
    return f"killed by {number.name} ({signal.strsignal(number)})"
