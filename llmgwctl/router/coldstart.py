"""Cold start as a routing state: a request for a model with no ready replica waits for one.

Owns the bounded per-model wait and the once-per-model wake. It must not know
how replicas start: it tells a `Waker` that demand exists and is told, through
`endpoints_changed`, when endpoints appear.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from .config import DEFAULTS
from .errors import RouterError

T = TypeVar("T")


class Waker(Protocol):
    """Asks the control plane to bring a model up.

    Exists so the router does not depend on the reconciler: in one process the
    controller implements it directly, a standalone router implements it as a
    POST to the controller. `wake` must return at once (it is called on the
    event loop); what starts, and whether anything can, is the controller's call.
    """

    def wake(self, model_name: str) -> None: ...


class QueueFull(RouterError):
    """More requests are already waiting for this model than the queue holds."""


class ColdTimeout(RouterError):
    """No replica became ready within the cold-start timeout."""


class _Waiting:
    __slots__ = ("count", "event")

    def __init__(self) -> None:
        self.count = 0
        self.event = asyncio.Event()


class ColdStart:
    # The defaults are RouterConfig's (cold_queue, cold_timeout), where their reasons are given.
    def __init__(self, waker: Waker | None, *, max_waiting: int = DEFAULTS.cold_queue,
                 timeout: float = DEFAULTS.cold_timeout,
                 clock: Callable[[], float] = time.monotonic):
        self._waker = waker
        self.max_waiting = max_waiting
        self.timeout = timeout
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}
        self._woken: dict[str, float] = {}   # model -> when we last woke it

    @property
    def can_wait(self) -> bool:
        """Without a waker nothing will ever come up, so waiting would only delay the 503."""
        return self._waker is not None

    def demand(self, model: str) -> None:
        """Wake `model`, once per cold period however many requests arrive.

        The period ends when an endpoint of the model appears or after one
        cold-start timeout (so a wake the controller lost is repeated, but at
        most once per timeout).
        """
        if self._waker is None:
            return
        now = self._clock()
        last = self._woken.get(model)
        if last is not None and now - last < self.timeout:
            return
        self._woken[model] = now
        self._waker.wake(model)

    def endpoints_changed(self, models: set[str]) -> None:
        for model in models:
            self._woken.pop(model, None)
            waiting = self._waiting.get(model)
            if waiting is not None:
                # Wake every waiter; each re-tries its pick. A fresh event for the next round.
                waiting.event.set()
                waiting.event = asyncio.Event()

    def nudge(self, models: set[str]) -> None:
        """Make the waiters of `models` re-try their pick now (what they may be told changed), without a new wake period."""
        for model in models:
            waiting = self._waiting.get(model)
            if waiting is not None:
                waiting.event.set()
                waiting.event = asyncio.Event()

    def waiting(self, model: str) -> int:
        w = self._waiting.get(model)
        return w.count if w else 0

    async def wait(self, model: str, pick: Callable[[], T | None]) -> T:
        """Wait until `pick()` returns something; QueueFull or ColdTimeout otherwise."""
        waiting = self._waiting.get(model)
        if waiting is None:
            waiting = self._waiting[model] = _Waiting()
        if waiting.count >= self.max_waiting:
            raise QueueFull(model)
        waiting.count += 1
        deadline = self._clock() + self.timeout
        try:
            while True:
                got = pick()
                if got is not None:
                    return got
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise ColdTimeout(model)
                try:
                    await asyncio.wait_for(waiting.event.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            waiting.count -= 1
            if waiting.count == 0 and self._waiting.get(model) is waiting:
                del self._waiting[model]
