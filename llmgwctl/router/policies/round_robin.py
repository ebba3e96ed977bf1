"""The `round-robin` policy: each candidate in turn, whatever its load; the baseline bench/routing.py measures against.

One turn counter per model, kept while the model has endpoints; the
balancer still filters by tier, room and ejection before the turn is taken.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..balancer import Balancer, EndpointState
from .plugin import PromptReader, Settings


class Turns:
    """One model's chooser: the next candidate after the one taken last."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def choose(self, cands: Sequence[EndpointState], now: float) -> EndpointState:
        i = self._next % len(cands)
        self._next = i + 1
        return cands[i]


class RoundRobin:
    """The plugin: a `Turns` per model, the same one for every request of that model."""

    __slots__ = ("_balancer", "_turns")

    def __init__(self, settings: Settings) -> None:
        self._balancer: Balancer = settings.balancer
        self._turns: dict[str, Turns] = {}

    def chooser(self, model: str, doc: Mapping[str, Any], headers: Mapping[str, str] | None,
                prompt: PromptReader | None) -> Turns:
        turns = self._turns.get(model)
        if turns is None:
            turns = self._turns[model] = Turns()
        return turns

    def forget(self, alive: set[EndpointState]) -> None:
        ready = self._balancer.ready_count
        self._turns = {m: t for m, t in self._turns.items() if ready(m)}
