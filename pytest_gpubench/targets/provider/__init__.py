"""Rented nodes: the marketplace API client (api.py) and the rented target's life cycle."""

from pytest_gpubench.targets.provider.target import ProviderTarget

__all__ = ["ProviderTarget"]
