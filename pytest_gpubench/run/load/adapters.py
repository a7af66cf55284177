"""Which LoRA adapter each request of a load point names, on a cell that chooses them per
request (`lora:` a list or mapping): in turn (`round_robin`) or drawn from the profile's seed
(`random`), each as often as its weight (`lora_weights`, all alike by default). A pure function
of the request's index, so that the client that sent a request and the recorder that writes it
down agree on its adapter without passing it along."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Literal

Choice = Literal["round_robin", "random"]


class AdapterChoice:
    """The adapter (an index into `names`) of each request index, made in index order once and
    kept: the same for every caller, in every process that is given the same choice."""

    def __init__(
        self,
        names: Sequence[str],
        choice: Choice = "round_robin",
        seed: int = 0,
        weights: Mapping[str, int] | None = None,
        *,
        in_order: bool = False,
    ) -> None:
        if not names:
            raise ValueError("an adapter choice needs adapters")
        self.names = tuple(names)
        self.choice = choice
        self.weights = tuple(int((weights or {}).get(name, 1)) for name in self.names)
        # Whether request i sends the point's i-th prompt whatever its adapter (a trace, replayed
        # as recorded); else each adapter takes the prompts in turn, so that round robin over 2
        # adapters and 2 prompts does not send each adapter one prompt only.
        self.in_order = in_order
        self._made: list[int] = []
        # Per request, how many requests before it named its adapter.
        self._turns: list[int] = []
        self._counts = [0] * len(self.names)
        self._draw = random.Random(f"lora:{seed}")
        # Smooth weighted round robin (each pick: every adapter gains its weight, the one
        # furthest ahead is picked and loses the total): each adapter exactly `weight` times in
        # every `sum(weights)` requests, spread out rather than in runs.
        self._current = [0] * len(self.names)

    def of(self, index: int) -> int:
        """The adapter of the `index`-th request (0-based)."""
        while len(self._made) <= index:
            made = self._next()
            self._made.append(made)
            self._turns.append(self._counts[made])
            self._counts[made] += 1
        return self._made[index]

    def prompt_of(self, index: int, prompts: int) -> int:
        """Which of the point's `prompts` (sent in turn) the `index`-th request sends."""
        if self.in_order:
            return index % prompts
        self.of(index)
        return self._turns[index] % prompts

    def name_of(self, index: int) -> str:
        return self.names[self.of(index)]

    def _next(self) -> int:
        if self.choice == "random":
            return self._draw.choices(range(len(self.names)), weights=self.weights)[0]
        total = sum(self.weights)
        self._current = [c + w for c, w in zip(self._current, self.weights, strict=True)]
        picked = max(range(len(self.names)), key=lambda i: (self._current[i], -i))
        self._current[picked] -= total
        return picked
