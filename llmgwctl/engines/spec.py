"""What a driver is (`Driver`) and what it hands back (`Launch`).

A driver is given a `ReplicaSpec` and reads pages into `LoadReading`s; both
cross pieces, so they live in `llmgwctl.contracts`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..contracts import LoadReading, ReplicaSpec


@dataclass(frozen=True, slots=True)
class Launch:
    """A process to start: argv, the environment to add, where to probe it."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    health_path: str
    metrics_path: str | None


class Driver(Protocol):
    """Knows one engine: how to launch it, whether this node can, how to read its load."""

    name: str

    def launch(self, spec: ReplicaSpec, *, host: str, port: int) -> Launch:
        """The process for `spec`, serving its API on host:port; a group's worker (rank > 0) serves
        none and is given port 0."""
        ...

    def available(self) -> tuple[bool, str]:
        """Whether this node can run the engine; if not, a reason with the fix."""
        ...

    def parse_metrics(self, text: str) -> LoadReading | None:
        """The load on a /metrics page, or None if the page has none of our families."""
        ...
