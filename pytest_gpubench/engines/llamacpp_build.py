"""Finds llama.cpp's llama-server, or builds it once from the pinned llama-cpp-python sdist."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pytest_gpubench.core.cache import cache_dir
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import atomic_file

# The sdist vendors a llama.cpp tree that its authors release and test together.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # Portable: the cached binary must not crash on an older CPU sharing the cache.
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
)
# The multimodal library the server links and cannot leave out (tools/mtmd: 52 of the build's
# compile units, clip.cpp alone about 39 s at -O3 on 2 cores) is compiled as one unity unit at -O0:
# the server runs none of it for text, and it takes 11 s instead of about 80 CPU-seconds. Injected
# with CMAKE_PROJECT_INCLUDE (no file of the sdist is changed), deferred until the target exists
# (cmake_language(DEFER), CMake 3.19 and later; an older CMake builds mtmd as before). Its helper
# files refuse to share a unit with mtmd's internals (an #error), so they stay units of their own.
FAST_MTMD_CMAKE = """\
if(NOT GPUBENCH_FAST_MTMD AND CMAKE_VERSION VERSION_GREATER_EQUAL 3.19)
  set(GPUBENCH_FAST_MTMD ON)
  function(gpubench_fast_mtmd)
    if(TARGET mtmd)
      get_target_property(sources mtmd SOURCES)
      get_target_property(source_dir mtmd SOURCE_DIR)
      foreach(source IN LISTS sources)
        if(source MATCHES "mtmd-helper")
          set_source_files_properties("${source_dir}/${source}" TARGET_DIRECTORY mtmd
            PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
        endif()
      endforeach()
      set_target_properties(mtmd PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
      set_property(TARGET mtmd APPEND PROPERTY COMPILE_OPTIONS -O0)
      message(STATUS "pytest-gpubench: mtmd compiled as one unity unit at -O0")
    endif()
  endfunction()
  cmake_language(DEFER CALL gpubench_fast_mtmd)
endif()
"""
# A CUDA build adds these (`gpubench install-server --cuda`); it is cached under its own key.
CUDA_FLAG = "-DGGML_CUDA=ON"
BINARY_NAME = "llama-server"
BINARY_ENV = "GPUBENCH_LLAMA_SERVER"
VERSION_TIMEOUT_S = 30.0
DOWNLOAD_TIMEOUT_S = 900.0
# Ninja prints "[12/206] ...", Makefiles "[ 12%] ...": the lines worth showing while building.
PROGRESS_LINE = re.compile(r"^\[\s*\d+(/\d+|%)\]")

Progress = Callable[[str], None]


def compiler_version() -> str:
    """The first line of `c++ --version`: a new compiler means a new cached build. Asked once a
    process for each `c++` that PATH finds (the build folder is named from it for the cached
    binary's path and again for the build): a process whose PATH changed for a while (a test's
    in-process session with a PATH of its own) asks again, rather than keep the answer of a PATH
    without a compiler and look for the built server where none was built."""
    return _compiler_version(shutil.which("c++"))


@functools.cache
def _compiler_version(compiler: str | None) -> str:
    if compiler is None:
        return "no c++ compiler"
    try:
        done = subprocess.run(
            [compiler, "--version"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "no c++ compiler"
    lines = done.stdout.splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else "no c++ compiler"


def build_key(version: str, flags: Sequence[str], compiler: str, machine: str) -> str:
    """A short hash of everything that decides the binary's bytes."""
    encoded = json.dumps([version, list(flags), compiler, machine]).encode()
    return hashlib.sha256(encoded).hexdigest()[:12]


def build_dir(
    cache_root: Path | None = None,
    *,
    version: str = LLAMA_CPP_PYTHON_VERSION,
    flags: Sequence[str] = CMAKE_FLAGS,
) -> Path:
    """`<cache>/llama-server/<version>-<key>`: the cached binary, its build log and lock."""
    root = cache_root if cache_root is not None else cache_dir()
    # The injected CMake script decides the binary's bytes too (mtmd's -O0).
    key = build_key(version, [*flags, FAST_MTMD_CMAKE], compiler_version(), platform.machine())
    return root / BINARY_NAME / f"{version}-{key}"


def cached_binary_path(
    cache_root: Path | None = None,
    *,
    version: str = LLAMA_CPP_PYTHON_VERSION,
    flags: Sequence[str] = CMAKE_FLAGS,
) -> Path:
    """Where the built llama-server is kept (it may not exist yet)."""
    return build_dir(cache_root, version=version, flags=flags) / BINARY_NAME


def cuda_flags(architectures: str = "native") -> tuple[str, ...]:
    """The build flags of a CUDA llama-server for these GPU architectures (`90` for Hopper,
    `native` for the GPUs of the machine that builds it)."""
    return (*CMAKE_FLAGS, CUDA_FLAG, f"-DCMAKE_CUDA_ARCHITECTURES={architectures}")


def answers_version(binary: Path) -> bool:
    """True when `binary --version` exits 0: a cached file that cannot run is rebuilt."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, timeout=VERSION_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def named_binary(value: str, origin: str) -> Path:
    """A llama-server the user named; naming one that is missing is an error, not a fallback."""
    found = shutil.which(value) if os.sep not in value else None
    path = Path(found) if found else Path(value).expanduser()
    if not path.is_file():
        raise GpubenchError(f"{origin}: {value} does not exist; give the path of a llama-server")
    if not os.access(path, os.X_OK):
        raise GpubenchError(f"{origin}: {value} is not executable")
    return path


def find_llama_server(explicit: str | None) -> Path | None:
    """The llama-server to use without building: explicit, $GPUBENCH_LLAMA_SERVER, PATH, cache."""
    if explicit:
        return named_binary(explicit, "server_binary")
    from_env = os.environ.get(BINARY_ENV, "").strip()
    if from_env:
        return named_binary(from_env, BINARY_ENV)
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        return Path(on_path)
    cached = cached_binary_path()
    if cached.is_file() and answers_version(cached):
        return cached
    return None


def ensure_llama_server(explicit: str | None = None, *, progress: Progress | None = None) -> Path:
    """A llama-server that runs: found as `find_llama_server` does, else built and cached."""
    found = find_llama_server(explicit)
    if found is not None:
        return found
    return build_llama_server(progress=progress)


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Held while `directory`'s cached server is built or installed: pytest-xdist workers may
    all ask at once; one builds, the others wait and reuse it."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_llama_server(
    *,
    progress: Progress | None = None,
    cache_root: Path | None = None,
    flags: Sequence[str] = CMAKE_FLAGS,
    sdist: Path | None = None,
) -> Path:
    """Build `llama-server` with cmake from the pinned sdist (downloaded, or the file `sdist`
    for a machine with no package index, a rented GPU node say) and cache it under its flags."""
    say = progress or _print_progress
    target_dir = build_dir(cache_root, flags=flags)
    binary = target_dir / BINARY_NAME
    if sdist is not None and not sdist.is_file():
        raise GpubenchError(f"--sdist: {sdist} does not exist; give a llama-cpp-python sdist")
    if CUDA_FLAG in flags and not shutil.which("nvcc"):
        raise GpubenchError(
            "cannot build a CUDA llama-server: nvcc is not on PATH (install the CUDA toolkit, "
            "or build without --cuda)"
        )
    try:
        with build_lock(target_dir):
            if binary.is_file() and answers_version(binary):
                return binary
            _build_into(binary, target_dir / "build.log", say, flags=flags, sdist=sdist)
    except OSError as exc:
        raise GpubenchError(f"llama-server build in {target_dir} failed: {exc}") from exc
    return binary


def _require_tools() -> list[str]:
    """The cmake generator arguments; missing build tools are the user's to install."""
    hint = f"or set {BINARY_ENV} to an existing llama-server"
    if not shutil.which("cmake"):
        raise GpubenchError(f"cannot build llama-server: cmake is not on PATH; install it {hint}")
    if not shutil.which("c++"):
        raise GpubenchError(
            f"cannot build llama-server: no C++ compiler (c++) on PATH; install one {hint}"
        )
    return ["-G", "Ninja"] if shutil.which("ninja") else []


@dataclass
class BuildLog:
    """The build's whole output goes to a file, its progress lines to the user with elapsed time."""

    file: TextIO
    path: Path
    say: Progress
    started: float = field(default_factory=time.monotonic)

    def progress(self, text: str) -> None:
        self.say(f"[{time.monotonic() - self.started:5.0f}s] {text}")


def _build_into(
    binary: Path, log_path: Path, say: Progress, *, flags: Sequence[str], sdist: Path | None
) -> None:
    generator = _require_tools()
    say(f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (log: {log_path})")
    with (
        tempfile.TemporaryDirectory(prefix="work-", dir=binary.parent) as work,
        log_path.open("w", encoding="utf-8") as file,
    ):
        log = BuildLog(file, log_path, say)
        if sdist is None:
            sdist = _download_sdist(Path(work) / "sdist", log)
            log.progress(f"downloaded {sdist.name}")
        source = _extract_llama_cpp(sdist, Path(work) / "src")
        include = Path(work) / "gpubench-fast-mtmd.cmake"
        include.write_text(FAST_MTMD_CMAKE, encoding="utf-8")
        arguments = [*generator, *flags, f"-DCMAKE_PROJECT_INCLUDE={include}"]
        built = _compile(source, Path(work) / "build", arguments, log)
        _install_binary(built, binary)
    if not answers_version(binary):
        raise GpubenchError(f"the built {binary} does not answer --version; see {log_path}")
    log.progress(f"llama-server built in {time.monotonic() - log.started:.0f} s: {binary}")


def _compile(source: Path, build: Path, arguments: list[str], log: BuildLog) -> Path:
    """Configure (generator and flags in `arguments`) and build the one target; returns the
    built binary."""
    log.progress("configuring with cmake")
    _run_logged(["cmake", "-S", str(source), "-B", str(build), *arguments], "configure", log)
    jobs = str(os.cpu_count() or 1)
    log.progress(f"compiling {BINARY_NAME} with {jobs} jobs")
    compile_ = ["cmake", "--build", str(build), "--config", "Release", "--target", BINARY_NAME]
    _run_logged([*compile_, "-j", jobs], "compile", log)
    return build / "bin" / BINARY_NAME


def _download_sdist(directory: Path, log: BuildLog) -> Path:
    requirement = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    argv += [requirement, "-d", str(directory)]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpubenchError(f"cannot download the {requirement} sdist with pip: {exc}") from exc
    log.file.write(done.stdout + done.stderr)
    sdists = sorted(directory.glob("*.tar.gz")) if directory.is_dir() else []
    if done.returncode != 0 or not sdists:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GpubenchError(f"cannot download the {requirement} sdist with pip: {last}")
    return sdists[0]


def _extract_llama_cpp(sdist: Path, directory: Path) -> Path:
    """Unpack only the vendored llama.cpp tree; the Python bindings are not needed."""
    try:
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
            if hasattr(tarfile, "data_filter"):
                archive.extractall(directory, members=members, filter="data")
            else:  # Python < 3.11.4 has no filters; the sdist is pip's checked PyPI download.
                archive.extractall(directory, members=members)
    except (tarfile.TarError, OSError) as exc:
        raise GpubenchError(f"cannot unpack {sdist.name}: {exc}") from exc
    sources = sorted(directory.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not sources:
        raise GpubenchError(f"{sdist.name} has no vendor/llama.cpp tree to build")
    return sources[0].parent


def _run_logged(argv: list[str], step: str, log: BuildLog) -> None:
    """Run one build step: every line to the log file, progress lines to the user."""
    log.file.write(f"$ {' '.join(argv)}\n")
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            log.file.write(line)
            if PROGRESS_LINE.match(line):
                log.progress(line.rstrip())
    if process.returncode != 0:
        raise GpubenchError(
            f"llama-server build failed at {step} (exit {process.returncode}); see {log.path}"
        )


def _install_binary(built: Path, binary: Path) -> None:
    if not built.is_file():
        raise GpubenchError(f"the build finished without producing {built}")
    # No one runs a half-copied binary; a lost one is built again.
    with atomic_file(binary, mode=0o755, durable=False) as partial:
        shutil.copy2(built, partial)
