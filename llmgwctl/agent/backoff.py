"""How long to wait before restarting a replica that crashed: the agent's numbers on the shared `Backoff`.

It must not know about processes: it only counts failures and time spent
ready. Time comes from the caller's clock, so the schedule is tested without
sleeping.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from ..backoff import Backoff

# 1 s first: a one-off crash (an OOM kill, a bad request) is back quickly.
INITIAL_DELAY = 1.0
# 60 s cap: a replica stuck crashing costs at most one start a minute, yet
# comes back within a minute of the cause being fixed (a disk freed, a driver reloaded).
MAX_DELAY = 60.0
# 5 min ready before a crash counts as a fresh start: longer than the
# "serves a few requests, then dies" crash loops we have seen, short against how
# long a healthy engine runs, so a crash days later restarts after 1 s again.
RESET_AFTER = 300.0


def restart_schedule(clock: Callable[[], float] = time.monotonic) -> Backoff:
    """A new replica's restart schedule.

    Not jittered: a crash is one engine's, on one machine, and no herd shares
    the retry; the exact floor is what keeps a crash loop from spinning.
    """
    return Backoff(initial=INITIAL_DELAY, cap=MAX_DELAY, reset_after=RESET_AFTER, jitter=0.0, clock=clock)
