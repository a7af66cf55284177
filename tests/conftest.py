"""Shared test set-up for the plugin's own tests."""

import os

# httpx imports httpcore lazily; importing it here keeps one copy alive across pytester's in-process
# runs (which drop modules first imported during a run), so httpx's exception mapping stays valid.
import httpcore  # noqa: F401

from pytest_gpubench.cache import cache_dir

# pytester points HOME at each test's directory; keep one cache (the llama-server build, the tiny
# model) shared by the in-process and subprocess runs, so they find what `make engine` made.
os.environ.setdefault("GPUBENCH_CACHE_DIR", str(cache_dir()))
