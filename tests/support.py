"""What tests of every piece share: one way to wait for a condition, one fake clock.

Waits poll a condition and fail naming it once a deadline passes; they never
judge a pass by how fast it was, and no test sleeps to let something become
ready. Time the code under test reads comes from `FakeClock`, which only moves
when a test moves it. A piece a synchronous test drives runs on a `LoopThread`.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

# Generous: the machine may be two shared cores, where starting a Python
# process alone can take seconds. Never reached when things work.
DEADLINE = 60.0


def _failed(what: str, timeout: float, last_error: BaseException | None) -> AssertionError:
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                          + (f" (last error: {last_error!r})" if last_error else ""))


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE, every: float = 0.05,
               errors: tuple[type[BaseException], ...] = (), nudge: Callable[[], object] | None = None) -> Any:
    """Poll `predicate` until it returns something truthy, and return that.

    `errors`: exceptions that mean "not yet" (a server still starting), the
    last one named in the failure. `nudge`: called before every poll, for a
    condition a test must provoke until it shows (an edit repeated until a
    watcher sees it), instead of sleeping until the watcher is armed.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        if nudge is not None:
            nudge()
        try:
            value = predicate()
            if value:
                return value
        except errors as exc:
            last_error = exc
        if time.monotonic() > deadline:
            raise _failed(what, timeout, last_error)
        time.sleep(every)


async def until(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE, every: float = 0.005,
                nudge: Callable[[], object | Awaitable[object]] | None = None) -> Any:
    """`wait_until` for a test on the event loop: polls without blocking the loop the code under test runs on."""
    deadline = time.monotonic() + timeout
    while True:
        if nudge is not None:
            nudged = nudge()
            if asyncio.iscoroutine(nudged):
                await nudged
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failed(what, timeout, None)
        await asyncio.sleep(every)


@contextlib.asynccontextmanager
async def local_server(app: Any) -> AsyncIterator[str]:
    """Serve an aiohttp `app` on 127.0.0.1 at a free port for the block; yields its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def need(ok: bool, reason: str, required_by: str, requires: str | None = None) -> None:
    """Skip the test unless `ok`; fail it instead when the environment sets `required_by` to 1.

    For what a machine may lack (a real engine, a model, a checker): CI sets
    the variable, so a missing piece there is a failure, never a quiet skip.
    """
    if ok:
        return
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{reason} ({required_by}=1 requires {requires})" if requires else f"{reason} ({required_by}=1)")
    pytest.skip(reason)


class FakeClock:
    """A monotonic clock for code that takes one (`clock=`): reads `now`, moves only when a test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class LoopThread:
    """An event loop of its own in a daemon thread, for a synchronous test to drive async code on.

    Subclasses start their piece on it and end with `close()`, which runs
    `shutdown()` on the loop before stopping it.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call_async(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the loop, where the piece's objects must be touched."""
        async def run() -> Any:
            return fn(*args)
        return self.call_async(run())

    def shutdown(self) -> None:
        """What `close` does on the loop first: stop the piece (nothing here)."""

    def close(self) -> None:
        try:
            self.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
