"""Which llama.cpp server a managed cell runs and why: a named llama-server first, the prebuilt
server where the machine runs its wheel (x86_64 Linux with AVX2), the source build where it does
not or where GPUBENCH_LLAMA_SERVER_BUILD forces it; and `gpubench install-server` saying so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.fake_llama import fake_binary, fake_sdist

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines import llamacpp_build
from pytest_gpubench.engines.llamacpp_build import BINARY_ENV, cached_binary_path
from pytest_gpubench.engines.llamacpp_choice import choose_llama_server
from pytest_gpubench.engines.llamacpp_prebuilt import (
    BUILD_ENV,
    LAUNCHER_MODULE,
    XLLAMACPP_VERSION,
    MachineFacts,
    build_forced,
    cpu_flags,
    llama_cpp_build,
    prebuilt_engine_version,
    prebuilt_refusal,
)

WITH_AVX2 = MachineFacts("Linux", "x86_64", frozenset({"sse4_2", "avx", "avx2", "fma"}))


@pytest.fixture
def bare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache and PATH, no llama-server named in the environment."""
    monkeypatch.setenv("GPUBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "on-path"))
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.delenv(BUILD_ENV, raising=False)
    return tmp_path


def test_x86_64_linux_with_avx2_runs_the_prebuilt_server(bare: Path) -> None:
    choice = choose_llama_server(None, environ={}, machine=WITH_AVX2)
    assert choice.kind == "prebuilt" and choice.maps_flags
    assert choice.command[1:] == ("-m", LAUNCHER_MODULE)
    assert choice.engine_version == prebuilt_engine_version()
    assert choice.describe() == (
        f"llama.cpp server: prebuilt xllamacpp {XLLAMACPP_VERSION} (llama.cpp "
        f"{llama_cpp_build()}): Linux x86_64 with AVX2 (/proc/cpuinfo flags); "
        f"{BUILD_ENV}=1 builds llama-server from source instead"
    )


@pytest.mark.parametrize(
    ("machine", "why"),
    [
        (MachineFacts("Linux", "x86_64", frozenset({"sse4_2", "avx"})), "this CPU has no AVX2 (/proc/cpuinfo flags), which the xllamacpp wheel needs"),
        (MachineFacts("Linux", "aarch64", frozenset({"fp", "asimd"})), "the xllamacpp wheel pinned here is for x86_64; this machine is aarch64"),
        (MachineFacts("Darwin", "x86_64", None), "the xllamacpp wheel pinned here is for Linux; this is Darwin"),
        (MachineFacts("Linux", "x86_64", None), "/proc/cpuinfo could not be read, so AVX2 (which the xllamacpp wheel needs) is unknown"),
    ],
    ids=["no-avx2", "arm", "macos", "no-cpuinfo"],
)  # fmt: skip
def test_a_machine_the_wheel_cannot_run_on_builds_from_source(
    bare: Path, machine: MachineFacts, why: str
) -> None:
    assert prebuilt_refusal(machine) == why
    choice = choose_llama_server(None, environ={}, machine=machine)
    assert choice.kind == "built" and not choice.maps_flags
    assert choice.engine_version is None  # the built server's own build_info is its version
    assert choice.describe().endswith(f": {why}")
    assert choice.command == ()  # not built yet


@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_environment_forces_the_source_build(bare: Path, value: str) -> None:
    choice = choose_llama_server(None, environ={BUILD_ENV: value}, machine=WITH_AVX2)
    assert choice.kind == "built"
    assert choice.reason == f"{BUILD_ENV}={value} forces the source build"
    assert build_forced({BUILD_ENV: "0"}) is None and build_forced({BUILD_ENV: ""}) is None


def test_a_cached_build_is_the_forced_choices_command(bare: Path) -> None:
    binary = fake_binary(cached_binary_path())
    choice = choose_llama_server(None, environ={BUILD_ENV: "1"}, machine=WITH_AVX2)
    assert choice.command == (str(binary),)


def test_a_named_llama_server_comes_before_the_prebuilt_one(bare: Path) -> None:
    explicit = fake_binary(bare / "mine" / "llama-server")
    from_env = fake_binary(bare / "env" / "llama-server")
    on_path = fake_binary(bare / "on-path" / "llama-server")
    forced = {BUILD_ENV: "1"}
    named = choose_llama_server(str(explicit), environ=forced, machine=WITH_AVX2)
    assert (named.kind, named.command, named.reason) == (
        "named", (str(explicit),), "the cell's server_binary"
    )  # fmt: skip
    os.environ[BINARY_ENV] = str(from_env)
    try:
        assert choose_llama_server(None, environ=os.environ, machine=WITH_AVX2).command == (
            str(from_env),
        )
    finally:
        del os.environ[BINARY_ENV]
    assert choose_llama_server(None, environ={}, machine=WITH_AVX2).command == (str(on_path),)
    # Forcing the build passes over a llama-server that merely sits on PATH.
    assert choose_llama_server(None, environ=forced, machine=WITH_AVX2).kind == "built"


def test_a_named_server_that_is_missing_is_still_an_error(bare: Path) -> None:
    with pytest.raises(GpubenchError, match=r"server_binary: .*does not exist"):
        choose_llama_server(str(bare / "nowhere"), environ={}, machine=WITH_AVX2)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n\nprocessor\t: 1\n")
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "sse", "avx2", "fma"})
    assert cpu_flags(tmp_path / "none") is None


def test_the_engine_version_names_the_package_and_its_llama_cpp_build() -> None:
    assert llama_cpp_build("2026.10.11549") == "b11549"
    assert prebuilt_engine_version("2026.10.11549") == "xllamacpp 2026.10.11549 (llama.cpp b11549)"


def test_install_server_forced_to_build_says_so_and_builds(
    bare: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`GPUBENCH_LLAMA_SERVER_BUILD=1 gpubench install-server` on a machine that runs the wheel:
    the source build, said with its reason and time, through the real cmake and compiler. The
    download of the 76 MB sdist is the one stand-in (a small sdist built here); the real tree's
    build is `make engine-build`'s, cached, and measured against the prebuilt server in
    test_llamacpp_prebuilt.py."""
    # The real cmake and compiler (no llama-server on this PATH: the build is what is chosen).
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")
    monkeypatch.setenv(BUILD_ENV, "1")
    sdist = fake_sdist(bare / "llama_cpp_python-0.0.0.tar.gz")
    monkeypatch.setattr(llamacpp_build, "_download_sdist", lambda directory, log: sdist)
    assert main(["install-server"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "llama.cpp server: llama-server built from source (llama-cpp-python "
        f"{llamacpp_build.LLAMA_CPP_PYTHON_VERSION}): {BUILD_ENV}=1 forces the source build"
    )
    assert any(line.startswith("[") and "llama-server built in" in line for line in out)
    assert out[-2].startswith("ready in ") and out[-1] == str(cached_binary_path())
    build_log = (cached_binary_path().parent / "build.log").read_text()
    assert "-DCMAKE_PROJECT_INCLUDE=" in build_log  # mtmd's unity -O0 script is passed to cmake
    capsys.readouterr()
    assert main(["install-server", "--build"]) == 0  # the cached build, reused
    assert capsys.readouterr().out.splitlines()[-1] == str(cached_binary_path())


def test_the_version_recorded_is_the_installed_wheel_s_metadata(tmp_path: Path) -> None:
    """The server answers `b0-unknown`: the version comes from the wheel's own METADATA."""
    from pytest_gpubench.engines.llamacpp_prebuilt import installed_version, package_dir

    assert installed_version(tmp_path) is None
    info = tmp_path / "xllamacpp-2026.10.11549.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.4\nName: xllamacpp\nVersion: 2026.10.11549\n\nVersion: not this\n"
    )
    assert installed_version(tmp_path) == "2026.10.11549"
    if (package_dir() / "xllamacpp").is_dir():  # `make engine` installed the real one
        assert installed_version(package_dir()) == XLLAMACPP_VERSION
