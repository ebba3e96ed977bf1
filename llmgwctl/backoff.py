"""How long to wait before trying again: one exponential schedule, with jitter, for every retry in llmgw.

Used for an agent's calls to a controller that is down, a standalone router's
watch reconnects, and an agent's restarts of an engine that crashed. Each user
chooses its own numbers (and says why where it does); this module owns only
the arithmetic and when the schedule resets.

Jitter is "full jitter": each delay is drawn uniformly below the schedule's
ceiling. Without it, every agent of a fleet (and every standalone router) that
lost the controller at the same moment retries at the same moments, and a
controller coming back meets all of them in the same millisecond, every round.
Drawn delays spread them over the whole interval, and the mean wait halves.
`jitter=0` keeps the schedule exact, for retries that no herd shares.

Time and randomness come from the caller (`clock`, `random`), so a schedule is
tested without sleeping and without chance.
"""
from __future__ import annotations

import random as _random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    initial: float                      # the first ceiling, in seconds
    cap: float                          # no ceiling grows past this
    factor: float = 2.0                 # doubling: halves the retry rate with each failure, the usual choice
    # Time spent ready after which the next failure starts the schedule over;
    # None: only `reset()` does (the caller knows when a retry succeeded).
    reset_after: float | None = None
    # 1.0 = full jitter (a delay anywhere below the ceiling); 0.0 = none; in
    # between, the delay is drawn from the top `jitter` share of the ceiling.
    jitter: float = 1.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    random: Callable[[], float] = field(default=_random.random, repr=False)    # in [0, 1)
    failures: int = 0
    ready_since: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be within 0..1, got {self.jitter}")

    def ceiling(self, failures: int) -> float:
        """The longest wait after `failures` failures in a row (1, 2, ...)."""
        return min(self.cap, self.initial * self.factor ** max(0, failures - 1))

    def failure(self) -> float:
        """One more failure: seconds to wait before the next try."""
        if (self.reset_after is not None and self.ready_since is not None
                and self.clock() - self.ready_since >= self.reset_after):
            self.failures = 0
        self.ready_since = None
        self.failures += 1
        top = self.ceiling(self.failures)
        return top * (1.0 - self.jitter * self.random())

    def ready(self) -> None:
        """The thing retried works again; once it has for `reset_after`, the next failure starts over."""
        self.ready_since = self.clock()

    def reset(self) -> None:
        """Forget past failures: the next failure waits at most `initial` again."""
        self.failures = 0
        self.ready_since = None
