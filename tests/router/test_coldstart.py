"""The cold-start queue and the once-per-model wake, without HTTP."""
from __future__ import annotations

import asyncio

import pytest

from llmgwctl.router.coldstart import ColdStart, ColdTimeout, QueueFull

from ..support import FakeClock


class RecordingWaker:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def wake(self, model_name: str) -> None:
        self.calls.append(model_name)


def test_wake_once_per_cold_period():
    waker, clock = RecordingWaker(), FakeClock(0.0)
    cold = ColdStart(waker, timeout=60, clock=clock)
    for _ in range(100):
        cold.demand("m")
    cold.demand("n")
    assert waker.calls == ["m", "n"]
    clock.now += 61          # a wake the controller lost is repeated, once per timeout
    cold.demand("m")
    assert waker.calls == ["m", "n", "m"]
    cold.endpoints_changed({"m"})     # an endpoint appeared: the next cold period wakes again
    cold.demand("m")
    assert waker.calls == ["m", "n", "m", "m"]


def test_without_a_waker_nothing_waits():
    cold = ColdStart(None)
    cold.demand("m")
    assert not cold.can_wait


async def test_waiters_are_served_when_an_endpoint_appears():
    cold = ColdStart(RecordingWaker(), timeout=30)
    ready: list[str] = []
    waiters = [asyncio.create_task(cold.wait("m", lambda: ready[0] if ready else None)) for _ in range(5)]
    await asyncio.sleep(0)
    assert cold.waiting("m") == 5
    ready.append("endpoint")
    cold.endpoints_changed({"m"})
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == ["endpoint"] * 5
    assert cold.waiting("m") == 0


async def test_queue_is_bounded():
    cold = ColdStart(RecordingWaker(), max_waiting=2, timeout=30)
    waiters = [asyncio.create_task(cold.wait("m", lambda: None)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await cold.wait("m", lambda: None)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert cold.waiting("m") == 0


async def test_timeout_raises():
    cold = ColdStart(RecordingWaker(), timeout=0.05)
    with pytest.raises(ColdTimeout):
        await asyncio.wait_for(cold.wait("m", lambda: None), 5)
