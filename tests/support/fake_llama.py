"""Stand-ins for llama-server's build: an executable whose only subject is its place in the
resolution order, and a llama-cpp-python-shaped sdist whose vendored "llama.cpp" builds a small
program named llama-server with the real cmake and compiler (the real tree takes minutes)."""

from __future__ import annotations

import tarfile
from pathlib import Path


def fake_binary(path: Path, exit_status: int = 0) -> Path:
    """A stand-in executable: only its place in the resolution order matters."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexit {exit_status}\n")
    path.chmod(0o755)
    return path


def fake_sdist(path: Path) -> Path:
    """The sdist at `path`; its llama-server prints `version: fake cuda=<GGML_CUDA>`, so that a
    CUDA build (-DGGML_CUDA=ON) says so."""
    tree = path.parent / "tree" / "llama_cpp_python-0.0.0" / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(fake CXX)\n"
        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "add_executable(llama-server main.cpp)\n"
        'target_compile_definitions(llama-server PRIVATE CUDA="${GGML_CUDA}")\n'
    )
    (tree / "main.cpp").write_text(
        '#include <cstdio>\nint main() { std::printf("version: fake cuda=%s\\n", CUDA); }\n'
    )
    with tarfile.open(path, "w:gz") as archive:
        archive.add(tree.parents[1], arcname="llama_cpp_python-0.0.0")
    return path
