"""A version number that long-polls wait on: bumped on every change, waited on by any number of clients."""
from __future__ import annotations

import time
from collections.abc import Callable

from ..aio import Waiters


class Broadcast:
    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        # Versions start at this process's start time in milliseconds, not at 1.
        # Watchers take any version other than their last as news, and a
        # restarted controller counting from 1 again soon reaches exactly the
        # version a router last saw from the old one: that router would take the
        # new controller's list for "no change" and hold its own for a whole
        # long-poll. A new life starts above every version the last one could
        # have handed out (that would take more than one change a millisecond).
        self.version = int(wall_clock() * 1000)
        # Resumed directly by a bump, in one step of the loop (see aio.Waiters).
        self._waiters = Waiters()
        # Long-polls held on the current version right now: what a change
        # would wake at once. Public so a test can see a poll held before it
        # changes anything, instead of sleeping and hoping it is.
        self.waiting = 0

    def bump(self) -> None:
        self.version += 1
        # Wake everyone waiting on the old version; a wait that starts after this waits anew.
        self._waiters.wake()

    async def wait(self, after: int | None, timeout: float) -> int:
        """The version once it differs from `after`, or the current one after `timeout`."""
        if self.version != after:
            return self.version
        self.waiting += 1
        try:
            await self._waiters.wait(timeout)
        finally:
            self.waiting -= 1
        return self.version
