"""How many examples each property test draws: its own count under Hypothesis's default profile
(`make test`, CI's), a quarter of it under the `fast` profile that `make test-fast` loads
(`--hypothesis-profile=fast`, registered in tests/conftest.py)."""

from __future__ import annotations

from hypothesis import settings

# Hypothesis's own default count, which a profile's max_examples is read against.
DEFAULT_EXAMPLES = 100
FAST_PROFILE = "fast"
FAST_EXAMPLES = 25
# Under the fast profile a test still draws at least this many.
FEWEST = 10


def register_profiles() -> None:
    """The fast profile: a quarter of the examples, for a quick local loop."""
    settings.register_profile(FAST_PROFILE, max_examples=FAST_EXAMPLES)


def examples(full: int) -> int:
    """`full` under the default profile; scaled like the loaded profile's max_examples under a
    lighter one (read when the test module is imported, after pytest loaded the profile)."""
    scale = min(1.0, settings().max_examples / DEFAULT_EXAMPLES)
    return full if scale == 1.0 else max(min(full, FEWEST), round(full * scale))
