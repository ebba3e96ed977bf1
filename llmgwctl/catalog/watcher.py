"""Following a catalog directory: every valid state is swapped into `Live`, no invalid one ever is.

Editors, `git pull` and `llmgwctl catalog apply` all end as file events in the
directory. The watcher groups a burst of events into one reload, validates the
*whole* directory, and swaps only when it is valid and its content changed.
A burst is what arrives within a few milliseconds, or, inside a git work tree,
everything written while git holds its index lock: one checkout, one swap.
A rejected state is remembered (time and every problem) for `status`, and the
catalog in force stays as it was.

`reload()` is the one-pass entry point tests drive directly; `run()` only calls
it when the filesystem says something changed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .diff import CatalogDiff, diff
from .errors import CatalogError, Problem
from .live import Live
from .loader import FileCache, is_catalog_file, load_dir
from .model import Catalog

log = logging.getLogger("llmgw.catalog")

# watchfiles yields a batch once no new event arrived for STEP_MS. 10 ms groups
# what one tool does in one go (an editor's write+rename, a checkout writing 30
# files back to back, each within a millisecond or two of the last) while
# keeping edit-to-in-force latency near the raw inotify floor; watchfiles'
# default of 50 ms alone costs more than our whole latency budget.
STEP_MS = 10
# ...and never waits longer than DEBOUNCE_MS for a burst to go quiet, so a tool
# that writes continuously (a slow rsync) still gets its valid states applied.
DEBOUNCE_MS = 1000
# While git holds its index lock it is writing the work tree (checkout, pull,
# reset): a batch seen then is a checkout half done, however slowly git goes
# (a git-lfs or git-crypt filter takes tens of ms a file, far past STEP_MS), so
# the load waits for the lock to go. A catalog repository's checkout takes well
# under a second even on a slow disk; a lock older than 10 s was left by a git
# that died (git never clears it), and the watcher stops waiting and says so.
GIT_LOCK_WAIT = 10.0


@dataclass(frozen=True, slots=True)
class Rejection:
    at: float                       # wall-clock time, for people reading status
    problems: tuple[Problem, ...]

    def to_dict(self) -> dict:
        return {"at": self.at, "errors": [str(p) for p in self.problems]}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one reload did: swapped (with the diff), found no change, or rejected."""

    catalog: Catalog                # the catalog in force afterwards
    swapped: bool = False
    diff: CatalogDiff | None = None
    rejection: Rejection | None = None


class CatalogWatcher:
    def __init__(self, directory: str | os.PathLike, live: Live, *,
                 wall_clock: Callable[[], float] = time.time,
                 step_ms: int = STEP_MS, debounce_ms: int = DEBOUNCE_MS, force_polling: bool = False):
        self.directory = os.fspath(directory)
        self.live = live
        self._wall = wall_clock
        self._step_ms, self._debounce_ms, self._force_polling = step_ms, debounce_ms, force_polling
        self._cache = FileCache()
        # Loads run on worker threads; two overlapping loads would race on the
        # cache and could swap an older state over a newer one.
        self._lock = threading.Lock()
        self.last_rejection: Rejection | None = None
        self.directory_valid = True
        self.swapped_at: float | None = None
        self.swaps = 0
        self.rejections = 0

    def load_initial(self) -> Catalog:
        """Load the directory and put it in force; CatalogError if it is invalid.

        At start there is no last good catalog to keep serving, so an invalid
        directory is the caller's decision (`serve` refuses to start rather than
        start empty and tear down every running replica).
        """
        with self._lock:
            catalog = load_dir(self.directory, cache=self._cache)
            self.live.swap(catalog)
            self.swapped_at = self._wall()
            log.info("catalog %s loaded from %s: %d models", catalog.version, self.directory, len(catalog))
            return catalog

    def reload(self) -> Outcome:
        """Validate the whole directory now; swap it in if valid and changed. Safe to repeat."""
        return self._apply(self._load())

    def _load(self) -> Catalog | tuple[Problem, ...]:
        with self._lock:
            try:
                return load_dir(self.directory, cache=self._cache)
            except CatalogError as exc:
                return exc.problems
            except OSError as exc:  # the directory itself vanished or became unreadable
                return (Problem(self.directory, (), f"cannot read the catalog directory: {exc.strerror or exc}"),)

    def _apply(self, loaded: Catalog | tuple[Problem, ...]) -> Outcome:
        if not isinstance(loaded, Catalog):
            return self._reject(loaded)
        self.directory_valid = True
        old = self.live.current
        if loaded.version == old.version:
            return Outcome(old)
        change = diff(old, loaded)
        self.live.swap(loaded)
        self.swapped_at = self._wall()
        self.swaps += 1
        log.info("catalog swapped %s -> %s: %s", old.version, loaded.version, change.summary(),
                 extra={"event": "catalog-swapped"})
        return Outcome(loaded, swapped=True, diff=change)

    def _reject(self, problems: tuple[Problem, ...]) -> Outcome:
        self.last_rejection = Rejection(self._wall(), tuple(problems))
        self.directory_valid = False
        self.rejections += 1
        current = self.live.current
        log.warning("catalog edit rejected, keeping %s in force (%d problem%s):\n  %s", current.version,
                    len(problems), "" if len(problems) == 1 else "s", "\n  ".join(str(p) for p in problems),
                    extra={"event": "catalog-rejected"})
        return Outcome(current, rejection=self.last_rejection)

    async def reload_async(self) -> Outcome:
        # Parsing and validating a big directory must not stall the event loop
        # (the router shares it); the swap is one assignment back on the loop.
        return self._apply(await asyncio.to_thread(self._load))

    async def run(self, stop_event: asyncio.Event | None = None, on_batch: Callable[[Outcome], None] | None = None) -> None:
        """Reload whenever the directory changes, until `stop_event` is set."""
        import watchfiles

        stop_event = stop_event or asyncio.Event()
        batches: asyncio.Queue = asyncio.Queue()

        async def follow() -> None:
            async for changes in watchfiles.awatch(
                self.directory, watch_filter=_relevant, step=self._step_ms, debounce=self._debounce_ms,
                stop_event=stop_event, force_polling=self._force_polling, recursive=True,
            ):
                batches.put_nowait(changes)

        follower = asyncio.create_task(follow())
        stopped = asyncio.create_task(stop_event.wait())
        try:
            while not stop_event.is_set():
                getter = asyncio.create_task(batches.get())
                await asyncio.wait({getter, stopped, follower}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    if follower.done():
                        follower.result()  # re-raise why watching stopped (directory gone...)
                    break
                await self._until_git_is_done(stop_event)
                while not batches.empty():  # one load covers every batch already queued
                    batches.get_nowait()
                loaded = await asyncio.to_thread(self._load)
                if not batches.empty():
                    # More of the same burst arrived while we validated (a slow
                    # checkout): that state is already stale, so don't swap it
                    # in only to swap again; the next pass loads the newer one.
                    continue
                outcome = self._apply(loaded)
                if on_batch:
                    on_batch(outcome)
        finally:
            stop_event.set()
            stopped.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    async def _until_git_is_done(self, stop_event: asyncio.Event) -> None:
        """Wait while a git command holds the index lock of the repository the directory is in."""
        lock = git_index_lock(self.directory)
        if lock is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GIT_LOCK_WAIT
        while os.path.exists(lock) and not stop_event.is_set():
            if loop.time() >= deadline:
                log.warning("%s has existed for %.0f s: loading the catalog anyway. If no git command is running, "
                            "a crashed one left it; remove it", lock, GIT_LOCK_WAIT)
                return
            await asyncio.sleep(self._step_ms / 1000)

    def status(self) -> dict:
        current = self.live.current
        return {
            "directory": self.directory, "version": current.version, "models": len(current),
            "swapped_at": self.swapped_at, "swaps": self.swaps, "rejections": self.rejections,
            "directory_valid": self.directory_valid,
            "last_rejection": self.last_rejection.to_dict() if self.last_rejection else None,
        }


def git_index_lock(directory: str) -> str | None:
    """The index.lock of the git work tree `directory` is in (at any depth), or None outside git."""
    path = os.path.abspath(directory)
    while True:
        dotgit = os.path.join(path, ".git")
        if os.path.isdir(dotgit):
            return os.path.join(dotgit, "index.lock")
        if os.path.isfile(dotgit):
            # A linked worktree or a submodule: .git is a file saying where the git directory is.
            try:
                with open(dotgit, encoding="utf-8") as f:
                    line = f.readline().strip()
            except OSError:
                return None
            if not line.startswith("gitdir:"):
                return None
            return os.path.join(path, line[len("gitdir:"):].strip(), "index.lock")
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _relevant(change: object, path: str) -> bool:
    # Catalog files, and anything under a `..`-prefixed directory: Kubernetes
    # swaps a ConfigMap by re-pointing `..data`, and the *.yaml symlinks we read
    # never change themselves. Editor scratch files don't wake us.
    name = os.path.basename(path)
    return is_catalog_file(name) or f"{os.sep}.." in path
