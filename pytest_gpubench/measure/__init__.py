"""Timed calls: one streamed request, the asyncio load client, the engine's gauges under load."""
