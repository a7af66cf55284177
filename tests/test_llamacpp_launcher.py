"""The prebuilt llama.cpp server's launcher: llama-server's flags onto xllamacpp's CommonParams,
a flag it does not map refused by name (never dropped), and the real CommonParams they set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.engines.llamacpp_launcher import (
    DEFAULT_PORT,
    FLAGS,
    LauncherFlagError,
    Setting,
    apply_settings,
    parse_server_args,
    physical_cores,
)
from pytest_gpubench.engines.llamacpp_prebuilt import BUILD_ENV, is_installed, package_dir


def fields(argv: list[str]) -> dict[str, Any]:
    return {setting.field: setting.value for setting in parse_server_args(argv)}


def test_the_managed_cells_flags_map_onto_common_params() -> None:
    """The argv the harness starts a managed llama.cpp cell with (managed_llamacpp.py), and the
    shipped cells.yaml's server_args."""
    mapped = fields(
        ["--model", "/m/tiny.gguf", "--alias", "tiny", "--host", "127.0.0.1", "--port", "8123",
         "--parallel", "4", "--no-webui", "--metrics", "--threads", "1"]
    )  # fmt: skip
    assert mapped == {
        "model.path": "/m/tiny.gguf",
        "model_alias": {"tiny"},
        "hostnames": ["127.0.0.1"],
        "port": 8123,
        "n_parallel": 4,
        "ui": False,
        "endpoint_metrics": True,
        "cpuparams.n_threads": 1,
        # As llama-server: --threads sets the batch threads too unless --threads-batch is given.
        "cpuparams_batch.n_threads": 1,
    }


def test_short_names_and_inline_values_read_as_the_long_ones() -> None:
    assert fields(["-m", "x.gguf", "-c", "2048", "-t", "2", "-np", "3", "--port=9000"]) == fields(
        ["--model", "x.gguf", "--ctx-size", "2048", "--threads", "2", "--parallel", "3",
         "--port", "9000"]
    )  # fmt: skip


def test_llama_servers_defaults_where_common_params_differ() -> None:
    """CommonParams' port 0 would listen anywhere and its threads -1 is resolved only by
    llama-server's own argument parser: the launcher sets llama-server's defaults."""
    mapped = fields(["--model", "x.gguf"])
    assert mapped["port"] == DEFAULT_PORT == 8080
    assert mapped["cpuparams.n_threads"] == mapped["cpuparams_batch.n_threads"] == physical_cores()
    assert fields(["-t", "2", "-tb", "1"])["cpuparams_batch.n_threads"] == 1


def test_physical_cores_count_hyperthreads_once(tmp_path: Path) -> None:
    for cpu, siblings in enumerate(["0,2", "1,3", "0,2", "1,3"]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    assert physical_cores(str(tmp_path)) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "x.gguf", "--rope-scaling", "yarn"], r"^--rope-scaling: not a llama-server flag the prebuilt llama.cpp server \(xllamacpp\) maps; to use it, run a built llama-server: set the cell's server_binary to one, or set GPUBENCH_LLAMA_SERVER_BUILD=1"),
        (["--threads"], r"^--threads: needs a value$"),
        (["--threads", "two"], r"^--threads: 'two' is not an integer$"),
        (["--metrics=1"], r"^--metrics: a switch, it takes no value$"),
        (["tiny.gguf"], r"^tiny.gguf: a value with no flag before it$"),
        (["--flash-attn", "maybe"], r"^--flash-attn: 'maybe' is none of on, off, auto$"),
        (["--cpu-mask", "zz"], r"^--cpu-mask: 'zz' is not a hex CPU mask$"),
    ],
    ids=["unknown-flag", "no-value", "not-an-integer", "switch-with-value", "stray-value",
         "bad-choice", "bad-mask"],
)  # fmt: skip
def test_what_the_launcher_cannot_map_is_one_line_naming_the_flag(
    argv: list[str], message: str
) -> None:
    with pytest.raises(LauncherFlagError, match=message) as raised:
        parse_server_args(argv)
    assert "\n" not in str(raised.value)
    if "maps" in message:
        assert BUILD_ENV in str(raised.value)


def test_every_flag_has_distinct_names() -> None:
    names = [name for flag in FLAGS for name in flag.names]
    assert len(names) == len(set(names))
    assert all(name.startswith("-") for name in names)


def _package() -> Any:
    """xllamacpp from the cache (`make engine`: gpubench install-server), skipped without it."""
    if not is_installed(package_dir()):
        pytest.skip("the prebuilt llama.cpp server is not installed: run `make engine`")
    from pytest_gpubench.engines.llamacpp_launcher import load_package

    return load_package()


def test_every_mapped_field_exists_on_the_real_common_params() -> None:
    """Each flag's fields are set on the installed wheel's CommonParams and read back: a field
    renamed by a new wheel fails here, not in a benchmark."""
    package = _package()
    values = {
        "-m": "x.gguf", "-a": "a,b", "--host": "0.0.0.0", "--port": "8123", "-np": "2",
        "-c": "512", "-n": "64", "-b": "256", "-ub": "128", "-t": "2", "-tb": "1",
        "--threads-http": "3", "-C": "0x5", "--cpu-strict": "1", "--poll": "10", "-ngl": "0",
        "-fa": "off", "--cache-reuse": "16", "-cram": "0", "--ctx-checkpoints": "4", "-s": "7",
        "--temp": "0.5", "--top-k": "5", "--top-p": "0.9", "--min-p": "0.1",
        "--chat-template": "chatml", "--api-key": "k", "-to": "30", "-lv": "1",
        "--sleep-idle-seconds": "60", "--pooling": "mean",
    }  # fmt: skip
    for flag in FLAGS:
        name = flag.names[0]
        argv = [name] if flag.convert is None else [name, values[name]]
        settings = parse_server_args(argv)
        params = package.CommonParams()
        apply_settings(params, settings, package)
        for setting in settings:
            target = params
            *path, field = setting.field.split(".")
            for part in path:
                target = getattr(target, part)
            read = getattr(target, field)
            expected = setting.value
            if field == "cpumask":
                assert read[: len(expected)] == expected and not any(read[len(expected) :])
            elif field == "flash_attn_type":
                assert read == package.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
            elif isinstance(expected, float):
                assert read == pytest.approx(expected)
            else:
                assert read == expected, f"{name} -> {setting.field}"


def test_the_launcher_refuses_an_unknown_flag_before_starting() -> None:
    """Run as the harness runs it: exit status 2 and one line on stderr, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest_gpubench.engines.llamacpp_launcher", "--model", "x.gguf",
         "--lora", "a.gguf"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("llamacpp_launcher: error: --lora: not a llama-server flag")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_settings_keep_the_flag_they_came_from() -> None:
    assert Setting("-t", "cpuparams_batch.n_threads", 2) in parse_server_args(["-t", "2"])
