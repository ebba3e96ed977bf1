"""How long to wait before restarting a replica that crashed.

Owns the exponential schedule and when it resets. Time comes from the
caller's clock, so the schedule is tested without sleeping. It must not know
about processes: it only counts failures and time spent ready.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
import time

# 1 s first: a one-off crash (an OOM kill, a bad request) is back quickly.
INITIAL_DELAY = 1.0
# 60 s cap: a replica stuck crashing costs at most one start a minute, yet
# comes back within a minute of the cause being fixed (a disk freed, a driver reloaded).
MAX_DELAY = 60.0
# 5 min ready before a crash counts as a fresh start: longer than the
# "serves a few requests, then dies" crash loops we have seen, short against how
# long a healthy engine runs, so a crash days later restarts after 1 s again.
RESET_AFTER = 300.0


@dataclass(slots=True)
class Backoff:
    initial: float = INITIAL_DELAY
    cap: float = MAX_DELAY
    factor: float = 2.0
    reset_after: float = RESET_AFTER
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    failures: int = 0
    ready_since: float | None = None

    def ready(self) -> None:
        """The replica passed its health check; a long enough run resets the schedule."""
        self.ready_since = self.clock()

    def failure(self) -> float:
        """The replica exited or failed to start: seconds to wait before the next start."""
        now = self.clock()
        if self.ready_since is not None and now - self.ready_since >= self.reset_after:
            self.failures = 0
        self.ready_since = None
        delay = min(self.cap, self.initial * self.factor ** self.failures)
        self.failures += 1
        return delay

    def reset(self) -> None:
        """Forget past failures: the next failure waits `initial` again."""
        self.failures = 0
        self.ready_since = None
