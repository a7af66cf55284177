"""Shared test set-up for the plugin's own tests."""

# httpx imports httpcore lazily; importing it here keeps one copy alive across pytester's in-process
# runs (which drop modules first imported during a run), so httpx's exception mapping stays valid.
import httpcore  # noqa: F401
