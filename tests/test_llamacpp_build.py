"""Finding or building llama-server: resolution order, cache key, cache reuse, build failures."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest
from support.fake_llama import fake_binary, fake_sdist

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines import llamacpp_build
from pytest_gpubench.engines.llamacpp_build import (
    BINARY_ENV,
    CMAKE_FLAGS,
    LLAMA_CPP_PYTHON_VERSION,
    BuildLog,
    build_key,
    build_llama_server,
    cached_binary_path,
    cuda_flags,
    ensure_llama_server,
    find_llama_server,
)


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """An isolated cache, PATH and environment, each holding its own fake llama-server."""
    monkeypatch.setenv("GPUBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "on-path"))
    monkeypatch.delenv(BINARY_ENV, raising=False)
    return {
        "explicit": fake_binary(tmp_path / "explicit" / "llama-server"),
        "env": fake_binary(tmp_path / "env" / "llama-server"),
        "path": fake_binary(tmp_path / "on-path" / "llama-server"),
        "cache": fake_binary(cached_binary_path()),
    }


def test_explicit_path_comes_first(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BINARY_ENV, str(places["env"]))
    assert find_llama_server(str(places["explicit"])) == places["explicit"]


def test_environment_comes_before_path(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BINARY_ENV, str(places["env"]))
    assert find_llama_server(None) == places["env"]


def test_path_comes_before_cache(places: dict[str, Path]) -> None:
    assert find_llama_server(None) == places["path"]


def test_cache_comes_last(places: dict[str, Path]) -> None:
    places["path"].unlink()
    assert find_llama_server(None) == places["cache"]
    assert places["cache"].parent.parent.name == "llama-server"
    assert places["cache"].parent.name.startswith(f"{LLAMA_CPP_PYTHON_VERSION}-")


def test_nothing_found_without_building(places: dict[str, Path]) -> None:
    places["path"].unlink()
    places["cache"].unlink()
    assert find_llama_server(None) is None


def test_a_named_binary_that_is_missing_is_an_error(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(GpubenchError, match=r"server_binary: .*does not exist"):
        find_llama_server(str(tmp_path / "nowhere" / "llama-server"))
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(GpubenchError, match=f"{BINARY_ENV}: .*does not exist"):
        find_llama_server(None)


def test_cache_key_changes_with_what_decides_the_binary() -> None:
    base = build_key("0.3.36", CMAKE_FLAGS, "c++ (Debian 12.2.0) 12.2.0", "x86_64")
    assert base == build_key("0.3.36", list(CMAKE_FLAGS), "c++ (Debian 12.2.0) 12.2.0", "x86_64")
    changed = {
        build_key("0.3.37", CMAKE_FLAGS, "c++ (Debian 12.2.0) 12.2.0", "x86_64"),
        build_key(
            "0.3.36", (*CMAKE_FLAGS, "-DGGML_CUDA=ON"), "c++ (Debian 12.2.0) 12.2.0", "x86_64"
        ),
        build_key("0.3.36", CMAKE_FLAGS, "c++ (Debian 13.1.0) 13.1.0", "x86_64"),
        build_key("0.3.36", CMAKE_FLAGS, "c++ (Debian 12.2.0) 12.2.0", "aarch64"),
    }
    assert base not in changed and len(changed) == 4
    assert cached_binary_path(version="0.3.37") != cached_binary_path()


def test_a_cached_binary_that_fails_version_is_rebuilt(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    places["path"].unlink()
    fake_binary(places["cache"], exit_status=1)
    assert find_llama_server(None) is None
    rebuilt = fake_binary(tmp_path / "rebuilt" / "llama-server")
    monkeypatch.setattr(llamacpp_build, "build_llama_server", lambda progress=None: rebuilt)
    assert ensure_llama_server() == rebuilt


def test_a_missing_cmake_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(GpubenchError, match="cmake is not on PATH") as raised:
        build_llama_server(cache_root=tmp_path, progress=lambda line: None)
    assert "\n" not in str(raised.value)


def test_build_progress_lines_carry_elapsed_time(tmp_path: Path) -> None:
    script = "echo '-- configuring'; echo '[1/2] Building a.o'; echo '[ 50%] Building b.o'"
    shown: list[str] = []
    output = io.StringIO()
    log = BuildLog(output, tmp_path / "build.log", shown.append)
    llamacpp_build._run_logged(["sh", "-c", script], "compile", log)
    assert [line.split("] ", 1)[1] for line in shown] == [
        "[1/2] Building a.o",
        "[ 50%] Building b.o",
    ]
    assert all(line.startswith("[") and "s] " in line for line in shown)
    assert "-- configuring" in output.getvalue()


def test_a_failed_build_step_names_the_step_and_log(tmp_path: Path) -> None:
    log_path = tmp_path / "build.log"
    with pytest.raises(GpubenchError, match=f"failed at compile \\(exit 3\\); see {log_path}"):
        log = BuildLog(io.StringIO(), log_path, lambda line: None)
        llamacpp_build._run_logged(["sh", "-c", "exit 3"], "compile", log)


@pytest.mark.engine
def test_the_real_cached_binary_answers_version(llama_server: Path) -> None:
    """The source build in the cache answers --version. Through `llama_server`, which waits for
    the build `make test` runs beside the suite: a fresh clone with empty caches skipped this
    test, run before the build had ended (CI=true, 2026-11-29), where CI fails what it cannot
    measure."""
    binary = cached_binary_path()
    if not binary.is_file():
        message = f"no llama-server built in the cache ({binary}): run `make engine-build`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0
    assert "version" in done.stdout + done.stderr


def test_a_cuda_build_from_a_local_sdist_is_cached_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`install-server --cuda --sdist FILE`: built from the file (no pip download), configured
    with the CUDA flags, cached under its own key beside the CPU build, reused the second time."""
    sdist = fake_sdist(tmp_path / "llama_cpp_python-0.0.0.tar.gz")
    fake_bin = fake_binary(tmp_path / "bin" / "nvcc")
    monkeypatch.setenv("PATH", f"{fake_bin.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(
        llamacpp_build, "_download_sdist", lambda *args: pytest.fail("downloaded the sdist")
    )
    cache = tmp_path / "cache"
    binary = build_llama_server(
        cache_root=cache, flags=cuda_flags("90"), sdist=sdist, progress=lambda line: None
    )
    assert binary.parent != cached_binary_path(cache).parent
    done = subprocess.run([str(binary)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "version: fake cuda=ON"
    build_log = (binary.parent / "build.log").read_text()
    assert "-DGGML_CUDA=ON" in build_log and "-DCMAKE_CUDA_ARCHITECTURES=90" in build_log
    stamp = binary.stat().st_mtime_ns
    again = build_llama_server(
        cache_root=cache, flags=cuda_flags("90"), sdist=sdist, progress=lambda line: None
    )
    assert again == binary and binary.stat().st_mtime_ns == stamp


def test_a_cuda_build_without_nvcc_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(GpubenchError, match="nvcc is not on PATH") as raised:
        build_llama_server(cache_root=tmp_path, flags=cuda_flags(), progress=lambda line: None)
    assert "\n" not in str(raised.value)


def test_a_missing_sdist_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(GpubenchError, match=r"--sdist: .*nothing\.tar\.gz does not exist"):
        build_llama_server(cache_root=tmp_path, sdist=tmp_path / "nothing.tar.gz")


def test_a_path_without_a_compiler_for_a_while_does_not_hide_the_built_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build folder is named from `c++ --version`, asked once a process. A process whose PATH
    held no compiler for a while (a test's in-process session with a PATH of its own) kept "no
    c++ compiler" for good, and looked for the built server in a folder of that name: under
    `make test-parallel` every later test of that worker that named the built binary failed "not
    built" (107 of them). Asked again for each compiler PATH finds, the folder is the build's."""
    monkeypatch.setenv("GPUBENCH_CACHE_DIR", str(tmp_path / "cache"))
    compilers = tmp_path / "compilers"
    compilers.mkdir()
    compiler = compilers / "c++"
    compiler.write_text("#!/bin/sh\necho 'c++ (Debian 12.2.0-14) 12.2.0'\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("PATH", str(compilers))
    built = cached_binary_path()
    monkeypatch.setenv("PATH", str(tmp_path / "no-compiler"))
    assert llamacpp_build.compiler_version() == "no c++ compiler"
    assert cached_binary_path() != built
    monkeypatch.setenv("PATH", str(compilers))
    assert llamacpp_build.compiler_version() == "c++ (Debian 12.2.0-14) 12.2.0"
    assert cached_binary_path() == built
