"""The asyncio idioms every piece uses, written once.

    sleep_unless   wait some seconds, or less if one of some events is set: the
                   tick of every loop, the delay of every retry, any long-poll
    run            run a process's main coroutine on uvloop when it is installed
    follow_file    wake on every change to one file, by watching its directory

Each was copied into several pieces before, with small differences, and one
copy of the first lacked the `try/finally` that cancels its waiters. This
module imports nothing of ours, so any piece may use it.
"""
from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Coroutine, TypeVar

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
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        done, _ = await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return bool(done)


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
