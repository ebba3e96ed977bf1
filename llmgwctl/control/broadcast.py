"""A version number that long-polls wait on: bumped on every change, waited on by any number of clients."""
from __future__ import annotations

import asyncio


class Broadcast:
    def __init__(self) -> None:
        self.version = 1
        self._event = asyncio.Event()

    def bump(self) -> None:
        self.version += 1
        # Wake everyone waiting on the old version, then start a fresh event for the next.
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, after: int | None, timeout: float) -> int:
        """The version once it differs from `after`, or the current one after `timeout`."""
        if self.version != after:
            return self.version
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.version
