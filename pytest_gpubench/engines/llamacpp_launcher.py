"""Runs the prebuilt llama.cpp server as a process of its own, as `llama-server` would run:
`python -m pytest_gpubench.engines.llamacpp_launcher --model M --port P ...` maps llama-server's
flags onto xllamacpp's `CommonParams`, starts its `Server` (llama.cpp's own HTTP server: the
same /health, /props, /tokenize, /metrics and streamed `timings`) and serves until SIGTERM.

A flag it does not map is refused by name before anything starts (`parse_server_args`, which
the harness calls too, so that a cell's `server_args` fail as one line); nothing is dropped.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines.llamacpp_prebuilt import (
    BUILD_ENV,
    PACKAGE,
    XLLAMACPP_VERSION,
    installed_version,
    is_installed,
    package_dir,
    prebuilt_engine_version,
)

# The usage error of a command line (core/status.py's EXIT_USAGE is pytest's, not a launcher's).
EXIT_USAGE = 2
HOW_TO_BUILD = (
    "to use it, run a built llama-server: set the cell's server_binary to one, or set "
    f"{BUILD_ENV}=1 (gpubench install-server then builds llama-server from source)"
)


class LauncherFlagError(GpubenchError):
    """A llama-server flag the launcher does not map, or a value it cannot read."""


def _integer(flag: str, text: str) -> int:
    try:
        return int(text, 0) if text.lower().startswith(("0x", "-0x")) else int(text)
    except ValueError:
        raise LauncherFlagError(f"{flag}: {text!r} is not an integer") from None


def _number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise LauncherFlagError(f"{flag}: {text!r} is not a number") from None


def _text(flag: str, text: str) -> str:
    return text


def _names(flag: str, text: str) -> set[str]:
    # llama-server's --alias takes a comma-separated list.
    return {name.strip() for name in text.split(",") if name.strip()}


def _one_item(flag: str, text: str) -> list[str]:
    return [text]


def _zero_or_one(flag: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise LauncherFlagError(f"{flag}: {text!r} is neither 0 nor 1")
    return text == "1"


def _on_off_auto(flag: str, text: str) -> str:
    if text not in ("on", "off", "auto"):
        raise LauncherFlagError(f"{flag}: {text!r} is none of on, off, auto")
    return text


# llama.cpp's llama_pooling_type, as --pooling names them.
_POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def _pooling(flag: str, text: str) -> int:
    if text not in _POOLING:
        raise LauncherFlagError(f"{flag}: {text!r} is none of {', '.join(_POOLING)}")
    return _POOLING[text]


def _cpu_mask(flag: str, text: str) -> list[bool]:
    """A hex mask of CPUs (`--cpu-mask 2`: CPU 1) as CommonParams' list of one bool a CPU."""
    digits = text[2:] if text.lower().startswith("0x") else text
    try:
        mask = int(digits, 16)
    except ValueError:
        raise LauncherFlagError(f"{flag}: {text!r} is not a hex CPU mask") from None
    return [bool(mask >> cpu & 1) for cpu in range(max(mask.bit_length(), 1))]


Convert = Callable[[str, str], Any]


@dataclass(frozen=True)
class Flag:
    """One llama-server flag: its names, the CommonParams fields it sets (dotted), and how its
    value is read (`convert`), or, for a switch, the value it sets."""

    names: tuple[str, ...]
    fields: tuple[str, ...]
    convert: Convert | None = None
    switch_value: Any = True


# llama-server's names (tools/server/README.md of the llama.cpp build the wheel holds), each
# onto the CommonParams field its own argument parser sets (common/arg.cpp).
FLAGS: tuple[Flag, ...] = (
    Flag(("-m", "--model"), ("model.path",), _text),
    Flag(("-a", "--alias"), ("model_alias",), _names),
    Flag(("--host",), ("hostnames",), _one_item),
    Flag(("--port",), ("port",), _integer),
    Flag(("-np", "--parallel"), ("n_parallel",), _integer),
    Flag(("-c", "--ctx-size"), ("n_ctx",), _integer),
    Flag(("-n", "--n-predict", "--predict"), ("n_predict",), _integer),
    Flag(("-b", "--batch-size"), ("n_batch",), _integer),
    Flag(("-ub", "--ubatch-size"), ("n_ubatch",), _integer),
    Flag(("-t", "--threads"), ("cpuparams.n_threads",), _integer),
    Flag(("-tb", "--threads-batch"), ("cpuparams_batch.n_threads",), _integer),
    Flag(("--threads-http",), ("n_threads_http",), _integer),
    Flag(("-C", "--cpu-mask"), ("cpuparams.cpumask",), _cpu_mask),
    Flag(("--cpu-strict",), ("cpuparams.strict_cpu",), _zero_or_one),
    Flag(("--poll",), ("cpuparams.poll",), _integer),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), ("n_gpu_layers",), _integer),
    Flag(("-fa", "--flash-attn"), ("flash_attn_type",), _on_off_auto),
    Flag(("--metrics",), ("endpoint_metrics",)),
    Flag(("--slots",), ("endpoint_slots",)),
    Flag(("--no-slots",), ("endpoint_slots",), switch_value=False),
    Flag(("--props",), ("endpoint_props",)),
    Flag(("--ui", "--webui"), ("ui",)),
    Flag(("--no-ui", "--no-webui"), ("ui",), switch_value=False),
    Flag(("-cb", "--cont-batching"), ("cont_batching",)),
    Flag(("-nocb", "--no-cont-batching"), ("cont_batching",), switch_value=False),
    Flag(("--cache-prompt",), ("cache_prompt",)),
    Flag(("--no-cache-prompt",), ("cache_prompt",), switch_value=False),
    Flag(("--cache-reuse",), ("n_cache_reuse",), _integer),
    Flag(("-cram", "--cache-ram"), ("cache_ram_mib",), _integer),
    Flag(("-kvu", "--kv-unified"), ("kv_unified",)),
    Flag(("--swa-full",), ("swa_full",)),
    Flag(("--ctx-checkpoints",), ("n_ctx_checkpoints",), _integer),
    Flag(("-s", "--seed"), ("sampling.seed",), _integer),
    Flag(("--temp",), ("sampling.temp",), _number),
    Flag(("--top-k",), ("sampling.top_k",), _integer),
    Flag(("--top-p",), ("sampling.top_p",), _number),
    Flag(("--min-p",), ("sampling.min_p",), _number),
    Flag(("--no-warmup",), ("warmup",), switch_value=False),
    Flag(("--jinja",), ("use_jinja",)),
    Flag(("--embedding", "--embeddings"), ("embedding",)),
    Flag(("--pooling",), ("pooling_type",), _pooling),
    Flag(("--no-jinja",), ("use_jinja",), switch_value=False),
    Flag(("--chat-template",), ("chat_template",), _text),
    Flag(("--api-key",), ("api_keys",), _one_item),
    Flag(("-to", "--timeout"), ("timeout_read", "timeout_write"), _integer),
    Flag(("-lv", "--verbosity", "--log-verbosity"), ("verbosity",), _integer),
    Flag(("--sleep-idle-seconds",), ("sleep_idle_seconds",), _integer),
)
_BY_NAME = {name: flag for flag in FLAGS for name in flag.names}
THREADS, THREADS_BATCH = "cpuparams.n_threads", "cpuparams_batch.n_threads"
# llama-server's own defaults where CommonParams' differ: port 0 would be any free port, and
# threads -1 is resolved by llama-server's argument parser (common/arg.cpp), not by the Server.
DEFAULT_PORT = 8080


@dataclass(frozen=True)
class Setting:
    """One CommonParams field set from the command line: `field` is dotted (`sampling.seed`)."""

    flag: str
    field: str
    value: Any


def parse_server_args(argv: Sequence[str]) -> list[Setting]:
    """llama-server flags (`--flag value` or `--flag=value`) as the CommonParams fields they
    set, in order; a flag not in FLAGS, a missing or unreadable value is a LauncherFlagError
    naming the flag. As llama-server does, `--threads` also sets the batch threads unless
    `--threads-batch` is given."""
    settings: list[Setting] = []
    words = list(argv)
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        name, equals, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        flag = _BY_NAME.get(name)
        if flag is None:
            if not name.startswith("-") or name == "-":
                raise LauncherFlagError(f"{word}: a value with no flag before it")
            raise LauncherFlagError(
                f"{name}: not a llama-server flag the prebuilt llama.cpp server ({PACKAGE}) "
                f"maps; {HOW_TO_BUILD}"
            )
        if flag.convert is None:
            if equals:
                raise LauncherFlagError(f"{name}: a switch, it takes no value")
            value = flag.switch_value
        else:
            if not equals:
                if index >= len(words):
                    raise LauncherFlagError(f"{name}: needs a value")
                inline = words[index]
                index += 1
            value = flag.convert(name, inline)
        settings.extend(Setting(name, field, value) for field in flag.fields)
    fields = {setting.field for setting in settings}
    if "port" not in fields:
        settings.append(Setting("--port", "port", DEFAULT_PORT))
    if THREADS not in fields:
        settings.append(Setting("--threads", THREADS, physical_cores()))
    if THREADS_BATCH not in fields:
        threads = next(s for s in reversed(settings) if s.field == THREADS)
        settings.append(Setting(threads.flag, THREADS_BATCH, threads.value))
    return settings


def physical_cores(cpu_root: str = "/sys/devices/system/cpu") -> int:
    """llama-server's default thread count: one a physical core (hyperthreads that share a
    core counted once, from sysfs), or os.cpu_count() where sysfs does not say."""
    import glob

    siblings = set()
    for path in glob.glob(f"{cpu_root}/cpu[0-9]*/topology/thread_siblings_list"):
        try:
            with open(path, encoding="ascii") as file:
                siblings.add(file.read().strip())
        except OSError:
            continue
    return len(siblings) or os.cpu_count() or 1


# -- the process ---------------------------------------------------------------------------------


def load_package() -> ModuleType:
    """xllamacpp from the cache (gpubench install-server put it there), at the pinned version."""
    directory = package_dir()
    if not is_installed(directory):
        raise GpubenchError(
            f"{PACKAGE} {XLLAMACPP_VERSION} is not installed in {directory}: run "
            "`gpubench install-server`"
        )
    sys.path.insert(0, str(directory))

    return importlib.import_module(PACKAGE)


def apply_settings(params: Any, settings: Sequence[Setting], package: ModuleType) -> None:
    """Set each field on a CommonParams (sub-objects such as `params.sampling` are views)."""
    for setting in settings:
        *path, name = setting.field.split(".")
        target = params
        for part in path:
            target = getattr(target, part)
        value = setting.value
        if name == "flash_attn_type":
            kinds = package.llama_flash_attn_type
            value = {
                "on": kinds.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                "off": kinds.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                "auto": kinds.LLAMA_FLASH_ATTN_TYPE_AUTO,
            }[value]
        if name == "cpumask":
            # CommonParams holds one bool for each CPU ggml may use (GGML_MAX_N_THREADS).
            value = [*value, *[False] * (len(target.cpumask) - len(value))]
            target.mask_valid = True
        setattr(target, name, value)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        if words == ["--version"]:
            load_package()
            version = installed_version(package_dir()) or XLLAMACPP_VERSION
            print(f"version: {prebuilt_engine_version(version)}", flush=True)
            return 0
        settings = parse_server_args(words)
        package = load_package()
        params = package.CommonParams()
        apply_settings(params, settings, package)
    except GpubenchError as exc:
        print(f"llamacpp_launcher: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    # Every thread the server starts inherits this mask: SIGTERM and Ctrl-C reach sigwait below.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        server = package.Server(params)
    except Exception as exc:  # the wheel's own error (a model it cannot load, a port in use)
        print(f"llamacpp_launcher: error: the server did not start: {exc}", file=sys.stderr)
        return 1
    print(
        f"llamacpp_launcher: {prebuilt_engine_version()} listening on {server.listening_address}",
        file=sys.stderr,
        flush=True,
    )
    signal.sigwait(stop_signals)
    # The process ends at once: the kernel frees the model and the port; nothing is left to save.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
