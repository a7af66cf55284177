"""pytest-gpubench: LLM inference benchmarks as pytest test cases."""

__version__ = "0.1.0"

# Bumped whenever the shape of a ledger record changes, so readers can tell old ledgers apart.
HARNESS_VERSION = 1
