"""The asyncio idioms every piece uses, written once.

    sleep_unless   wait some seconds, or less if one of some events is set: the
                   tick of every loop, the delay of every retry, any long-poll
    cancel_and_wait  take tasks down and wait until they have ended: every shutdown
    Waiters        long-polls held until something happens, each woken in one step of the loop
    run            run a process's main coroutine on uvloop when it is installed
    follow_file    wake on every change to one file, by watching its directory

One helper per idiom: copies with small differences drift, as a missing
`try/finally` that cancels a wait's waiters, or a cancel-then-await that
swallows the caller's own cancellation. This module imports nothing of
ours, so any piece may use it.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# A file's follower groups what arrives within 10 ms into one wake (an editor's
# write + rename, a config manager's temp file + rename) and never holds a
# burst longer than 1 s: the catalog watcher's numbers, for the same editors.
STEP_MS = 10
DEBOUNCE_MS = 1000


async def sleep_unless(seconds: float | None, *events: asyncio.Event) -> bool:
    """Return after `seconds` (None: no limit), or as soon as one of `events` is set.

    True if an event ended the wait (one already set ends it at once), False
    if the time ran out. The waiters are cancelled however this returns, a
    cancellation of the caller included, so none is left behind on the loop.
    """
    if any(event.is_set() for event in events):
        return True
    if not events:
        if seconds is None:
            raise ValueError("sleep_unless with no event and no time limit would never return")
        await asyncio.sleep(seconds)
        return False
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[bool] = loop.create_future()
    # A Flag resolves `woken` itself when set: the caller resumes one step of the
    # loop later. A plain Event is waited on by a task of its own, which takes
    # three (see Flag).
    waiters = []
    for event in events:
        if isinstance(event, Flag):
            event._futures.add(woken)
        else:
            waiter = asyncio.ensure_future(event.wait())
            waiter.add_done_callback(lambda _: _resolve(woken, True))
            waiters.append(waiter)
    timer = loop.call_later(max(0.0, seconds), _resolve, woken, False) if seconds is not None else None
    try:
        return await woken
    finally:
        for event in events:
            if isinstance(event, Flag):
                event._futures.discard(woken)
        for waiter in waiters:
            waiter.cancel()
        if timer is not None:
            timer.cancel()


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` and return once each has ended; what they returned or raised is dropped.

    For shutdowns and for a helper task whose outcome no longer matters. A
    task left running past its owner's end would fail unseen ("exception was
    never retrieved") or outlive what it uses. If the caller itself is
    cancelled while waiting, CancelledError reaches it as usual: the tasks
    were cancelled already, and only their end is not waited for. Swallowing
    that cancellation instead would keep a cancelled handler running.
    """
    running = []
    for task in tasks:
        if task.done():
            if not task.cancelled():
                task.exception()        # retrieved, so asyncio does not log it as lost
        else:
            task.cancel()
            running.append(task)
    if running:
        # gather(return_exceptions=True) collects the tasks' CancelledErrors as
        # outcomes, but a cancellation of gather itself (of the caller) still raises.
        await asyncio.gather(*running, return_exceptions=True)


class Flag(asyncio.Event):
    """An asyncio.Event that `sleep_unless` wakes from in one step of the loop.

    Set on an Event, `sleep_unless` resumes its caller three steps later: the
    event's waiter task, its done callback, then the caller. On a loop that
    also takes a stream of reports, every step runs each callback that came
    ready meanwhile, so at fleet size each step is long and a pass woken by a
    report starts three of them late (bench/README.md, "Figures behind the
    comments"). A Flag resolves the sleeping caller's own future when set: one step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._futures: set[asyncio.Future[bool]] = set()

    def set(self) -> None:
        super().set()
        futures, self._futures = self._futures, set()
        for future in futures:
            _resolve(future, True)


class Waiters:
    """Tasks waiting for one thing to happen (or their own timeout): `wake()` resumes them all at once.

    For the long-polls a server holds by the thousand (agents' desired lists,
    routers' watches). `sleep_unless` on an Event resumes its caller three
    steps of the loop after the set: the event's waiter task, then
    asyncio.wait's callback, then the caller -- and a long-poll waiting on a
    wait of its own, six. On a loop that also takes a stream of reports, each
    step runs every callback that came ready meanwhile, so at fleet size an
    answer held six steps goes out long after the change that woke it. Here
    the woken task is the one awaiting the future that `wake` resolves: one step.
    """

    def __init__(self) -> None:
        self._futures: set[asyncio.Future[bool]] = set()

    def __len__(self) -> int:
        return len(self._futures)

    async def wait(self, timeout: float | None) -> bool:
        """True once woken, False when `timeout` seconds (None: no limit) ran out first."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._futures.add(future)
        timer = loop.call_later(max(0.0, timeout), _resolve, future, False) if timeout is not None else None
        try:
            return await future
        finally:
            self._futures.discard(future)
            if timer is not None:
                timer.cancel()

    def wake(self) -> None:
        """Resume every task waiting now (call on the loop's thread); ones that wait after this wait anew."""
        futures, self._futures = self._futures, set()
        for future in futures:
            _resolve(future, True)


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def run(main: Coroutine[object, object, T]) -> T:
    """Run `main` to its end on uvloop when it is installed, else on asyncio's own loop.

    uvloop (the optional extra `fast`) costs several times fewer CPU cycles per
    proxied request; everything works without it, slower.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def follow_file(path: str | os.PathLike[str], stop: asyncio.Event, *, recheck: float | None = None,
                      step_ms: int = STEP_MS, debounce_ms: int = DEBOUNCE_MS,
                      force_polling: bool = False) -> AsyncIterator[None]:
    """Yield each time `path` may have changed -- written, created, replaced, removed -- until `stop` is set.

    The directory is watched, not the file: editors and config managers
    replace a file by renaming a new one over it, which a watch on the old
    inode never sees, and a file that does not exist yet has no inode to
    watch. With `recheck`, it also yields every `recheck` seconds without an
    event, so a reader that checks cheaply for a change (size, mtime, inode)
    also catches what inotify cannot report (an edit on another NFS client,
    a change in the moment before the watch was armed).

    FileNotFoundError if the directory does not exist.
    """
    import watchfiles

    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    # rust_timeout=None is awatch's own default (wait for an event or stop only).
    timeout_ms = None if recheck is None else max(1, int(recheck * 1000))
    async for _ in watchfiles.awatch(directory, watch_filter=lambda change, p: os.path.basename(p) == name,
                                     step=step_ms, debounce=debounce_ms, stop_event=stop, recursive=False,
                                     force_polling=force_polling, rust_timeout=timeout_ms,
                                     yield_on_timeout=recheck is not None):
        yield
