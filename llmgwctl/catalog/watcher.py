"""Following a catalog directory: every valid state is swapped into `Live`, no invalid one ever is.

Editors, `git pull` and `llmgwctl catalog apply` all end as file events in the
directory. The watcher groups a burst of events into one reload, validates the
*whole* directory, and swaps only when it is valid and its content changed.
A burst is what arrives within a few milliseconds, or, inside a git work tree,
everything written while git holds its index lock: one checkout, one swap.
A rejected state is remembered (time and every problem) for `status`, and the
catalog in force stays as it was.

A file rewritten in place (an editor that truncates and writes, `cp`, a
copy over a slow link) is half written for a while: its events are followed
until the directory has been quiet for QUIET_MS before it is validated, so a
writer pausing mid-file never gets its half swapped in. A file renamed into
place (`catalog apply`, most editors, a ConfigMap's `..data` swap) is
complete when it appears and is taken at once.

`run()` is supervised: whatever one reload raises is logged with its
traceback, counted in `failures` (and /metrics), shown in status, and the
loop goes on from the catalog in force; it never stops anything but itself.
Reads run on a daemon thread with a time bound, so a hung filesystem can
neither stall the loop nor keep `serve` from exiting.

The directory is followed by what it resolves to, looked up again every
RECHECK seconds: a release-style switch (`current -> release-1` replaced by a
renamed link to release-2, release-1 removed) moves the watch to release-2
and loads it, so later edits and `catalog apply` take effect; a watch on the
old directory would see nothing ever again. A directory that went away (or
is no longer one) is shown in status as the watcher degraded, with why, the
catalog in force stays, and it is followed again as soon as it is back.

`reload()` is the one-pass entry point tests drive directly; `run()` only calls
it when the filesystem says something changed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..fsutil import file_kind, off_loop
from ..health import Failure, error_text, failure
from .diff import CatalogDiff, diff
from .errors import CatalogError, Problem

if TYPE_CHECKING:
    # watchfiles is imported where the watch starts (a loaded catalog needs no watcher).
    from watchfiles import Change as FileChange

    Batch = set[tuple[FileChange, str]]   # one awatch() yield: what changed, where

from .live import Live
from .loader import DEFAULT_LIMITS, FileCache, Limits, is_catalog_file, load_dir
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
# A file written in place is validated once no event touched it for this
# long. Writers pause mid-file for tens to hundreds of ms (descheduled, a
# buffer flushed in chunks, a pipe waiting on its producer: 20-200 ms were
# seen); 2 s is ten times the longest of those, and an in-place save taking
# effect 2 s later is still "live" to a person. A rename into place does not
# wait. A writer that stalls longer should write a temp file and rename it,
# as `catalog apply` does.
QUIET_MS = 2000
# How long one load (read + validate the whole directory) may take before it
# is given up and reported: a load within the loader's limits takes ~3 s at
# worst; past 30 s the filesystem is hung (a dead NFS server), and waiting
# longer would only hide that from status.
LOAD_TIMEOUT = 30.0
# After watching the directory failed (it was removed, inotify ran out of
# watches), try again this often: soon enough that an edit after the
# directory is back is not missed for long, rarely enough not to spin.
REWATCH_EVERY = 1.0
# How often what the directory resolves to is looked up again (a realpath and
# a stat on a worker thread): a release switch or a directory removed and put
# back is followed within this long, and an inotify watch cannot tell us
# either (it stays on the old directory's inode).
RECHECK = 1.0


@dataclass(frozen=True, slots=True)
class Rejection:
    at: float                       # wall-clock time, for people reading status
    problems: tuple[Problem, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "errors": [str(p) for p in self.problems]}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one reload did: swapped (with the diff), found no change, or rejected."""

    catalog: Catalog                # the catalog in force afterwards
    swapped: bool = False
    diff: CatalogDiff | None = None
    rejection: Rejection | None = None


class CatalogWatcher:
    def __init__(self, directory: str | os.PathLike[str], live: Live, *,
                 wall_clock: Callable[[], float] = time.time,
                 step_ms: int = STEP_MS, debounce_ms: int = DEBOUNCE_MS, force_polling: bool = False,
                 quiet_ms: int = QUIET_MS, load_timeout: float = LOAD_TIMEOUT, limits: Limits = DEFAULT_LIMITS,
                 recheck: float = RECHECK):
        self.directory = os.fspath(directory)
        self.live = live
        self._wall = wall_clock
        self._step_ms, self._debounce_ms, self._force_polling = step_ms, debounce_ms, force_polling
        self._quiet_ms, self._load_timeout, self._limits = quiet_ms, load_timeout, limits
        self._recheck = recheck
        self._cache = FileCache()
        # Loads run on worker threads; two overlapping loads would race on the
        # cache and could swap an older state over a newer one. Taken with a
        # timeout: a load stuck on a hung filesystem must not stall every next one.
        self._lock = threading.Lock()
        self.last_rejection: Rejection | None = None
        self.directory_valid = True
        self.swapped_at: float | None = None
        self.swaps = 0
        self.rejections = 0
        # Reloads that raised something no rule expected (a bug, a hung read),
        # and the last one: /metrics counts them, status shows the watcher degraded.
        self.failures = 0
        self.last_failure: Failure | None = None
        self.degraded = False
        # What the directory resolves to and is watched as; why it cannot be
        # followed now (gone, not a directory), and since when.
        self.followed: str | None = None
        self.problem: str | None = None
        self.problem_since: float | None = None
        self._locating = threading.Lock()

    def load_initial(self) -> Catalog:
        """Load the directory and put it in force; CatalogError if it is invalid.

        At start there is no last good catalog to keep serving, so an invalid
        directory is the caller's decision (`serve` refuses to start rather than
        start empty and tear down every running replica).
        """
        with self._lock:
            catalog = load_dir(self.directory, cache=self._cache, limits=self._limits)
            self.live.swap(catalog)
            self.swapped_at = self._wall()
            log.info("catalog %s loaded from %s: %d models", catalog.version, self.directory, len(catalog))
            return catalog

    def reload(self) -> Outcome:
        """Validate the whole directory now; swap it in if valid and changed. Safe to repeat."""
        return self._apply(self._load())

    def _load(self) -> Catalog | tuple[Problem, ...]:
        if not self._lock.acquire(timeout=self._load_timeout):
            return (Problem(self.directory, (), f"an earlier read of the catalog directory has not finished after "
                                                f"{self._load_timeout:.0f} s; is its filesystem hung?"),)
        try:
            return load_dir(self.directory, cache=self._cache, limits=self._limits)
        except CatalogError as exc:
            return exc.problems
        except OSError as exc:  # the directory itself vanished or became unreadable
            return (Problem(self.directory, (), f"cannot read the catalog directory: {exc.strerror or exc}"),)
        finally:
            self._lock.release()

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

    async def _load_off_loop(self) -> Catalog | tuple[Problem, ...]:
        """`_load` on a daemon thread (`fsutil.off_loop`), given up after the load timeout."""
        try:
            return await off_loop(self._load, self._load_timeout, "catalog-load")
        except TimeoutError:
            return (Problem(self.directory, (), f"reading and validating the catalog directory took longer than "
                                                f"{self._load_timeout:.0f} s; is its filesystem hung?"),)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        self.degraded = True
        self.last_failure = failure(what, error_text(exc), self._wall())
        log.error("catalog watcher: %s failed; keeping %s in force and watching on:\n%s", what,
                  self.live.current.version, "".join(traceback.format_exception(exc)).rstrip(),
                  extra={"event": "catalog-watcher-failed"})

    async def run(self, stop_event: asyncio.Event | None = None, on_batch: Callable[[Outcome], None] | None = None) -> None:
        """Reload whenever the directory changes, until `stop_event` is set. Never raises but on cancel."""
        import watchfiles

        stop_event = stop_event or asyncio.Event()
        batches: asyncio.Queue[Batch] = asyncio.Queue()

        async def follow(target: str, halt: asyncio.Event) -> None:
            async for changes in watchfiles.awatch(
                target, watch_filter=_relevant, step=self._step_ms, debounce=self._debounce_ms,
                stop_event=halt, force_polling=self._force_polling, recursive=True,
            ):
                batches.put_nowait(changes)

        # (what the directory resolved to, the task watching it, the event that ends that watch)
        watch: tuple[tuple[str, int, int], asyncio.Task[None], asyncio.Event] | None = None
        getter: asyncio.Task[Batch] | None = None
        stopped = asyncio.create_task(stop_event.wait())

        async def unwatch() -> None:
            nonlocal watch
            if watch is not None:
                watch[2].set()      # ends our own watch; the caller's stop_event is only ever read
                await asyncio.gather(watch[1], return_exceptions=True)
                watch = None

        loop = asyncio.get_running_loop()
        located_at = -float("inf")
        try:
            while not stop_event.is_set():
                # Where the directory is, once a recheck interval (not on every
                # batch: an edit's way to in force takes no thread hop for it).
                if watch is not None and loop.time() - located_at < self._recheck:
                    place: tuple[str, int, int] | str = watch[0]
                else:
                    place, located_at = await self._locate_off_loop(), loop.time()
                if isinstance(place, str):
                    await unwatch()
                    self._lost(place)
                elif watch is None or place != watch[0]:
                    moved = watch is not None or self.problem is not None
                    await unwatch()
                    halt = asyncio.Event()
                    watch = (place, asyncio.create_task(follow(place[0], halt)), halt)
                    self._found(place[0])
                    if not moved:
                        # The first watch: an edit made after the start's load and
                        # before the watch was armed would wait, unseen, for the
                        # next edit (an operator who edits as serve comes up; a
                        # CI job that applies right after start). One step lets
                        # the new task arm it (awatch makes its watcher before
                        # its first wait); one load then covers the gap, cheap
                        # when nothing changed (unchanged files come from the cache).
                        await asyncio.sleep(0)
                    batches.put_nowait(set())   # load what it holds now
                if getter is None:
                    getter = asyncio.create_task(batches.get())
                waits = {getter, stopped} | ({watch[1]} if watch is not None else set())
                await asyncio.wait(waits, timeout=self._recheck, return_when=asyncio.FIRST_COMPLETED)
                if stop_event.is_set():
                    break
                if watch is not None and watch[1].done():
                    # Watching stopped (out of inotify watches, the directory
                    # went): say why, and watch again once it can be.
                    follower = watch[1]
                    exc = follower.exception() if not follower.cancelled() else None
                    self._failed("watching the directory", exc or RuntimeError("the watch ended"))
                    watch = None
                    await asyncio.wait({stopped}, timeout=REWATCH_EVERY)
                    batches.put_nowait(set())   # what changed meanwhile was not seen: load once
                    continue
                if not getter.done():
                    continue        # a recheck of where the directory is: nothing changed in it
                changes, getter = getter.result(), None
                try:
                    outcome = await self._settle_and_load(changes, batches, stop_event)
                    if outcome is not None:
                        self.degraded = False
                        if on_batch:
                            on_batch(outcome)
                except Exception as exc:  # noqa: BLE001 -- supervised: one bad pass must not end the watch
                    self._failed("reloading the catalog", exc)
        finally:
            await unwatch()
            stopped.cancel()
            if getter is not None:
                getter.cancel()

    def _locate(self) -> tuple[str, int, int] | str:
        """What the directory resolves to now (real path, device, inode), or why it cannot be followed. Blocking."""
        if not self._locating.acquire(blocking=False):
            return f"{self.directory}: an earlier look at it has not finished; is its filesystem hung?"
        try:
            real = os.path.realpath(self.directory)
            try:
                st = os.stat(real)
            except FileNotFoundError:
                link = f" (a symlink to {real}, which does not exist)" if os.path.islink(self.directory) else ""
                return f"{self.directory}: the catalog directory does not exist{link}; removed, or not mounted?"
            except OSError as exc:
                return f"{self.directory}: cannot look at the catalog directory: {exc.strerror or exc}"
            if not stat.S_ISDIR(st.st_mode):
                return f"{self.directory}: is {file_kind(st.st_mode)}, not a directory"
            return real, st.st_dev, st.st_ino
        finally:
            self._locating.release()

    async def _locate_off_loop(self) -> tuple[str, int, int] | str:
        try:
            return await off_loop(self._locate, self._load_timeout, "catalog-locate")
        except TimeoutError:
            return f"{self.directory}: looking at the catalog directory took longer than {self._load_timeout:.0f} s; " \
                   "is its filesystem hung?"

    def _lost(self, why: str) -> None:
        """The directory cannot be followed: degraded with why (counted and logged once), the catalog stays."""
        self.followed = None
        if why == self.problem:
            return
        now = self._wall()
        self.problem = why
        self.problem_since = self.problem_since or now
        self.failures += 1
        self.last_failure = failure("following the directory", why, now)
        log.error("catalog watcher: %s; keeping %s in force, and following the directory again once it is back",
                  why, self.live.current.version, extra={"event": "catalog-directory-lost"})

    def _found(self, real: str) -> None:
        if self.problem is not None or (self.followed is not None and self.followed != real):
            log.warning("catalog watcher: following %s, now %s", self.directory, real,
                        extra={"event": "catalog-directory-followed"})
        self.followed = real
        self.problem = self.problem_since = None

    def why_not_in_force(self) -> str:
        """Why a state written to the directory may not be in force yet: for an apply that waited in vain."""
        if self.problem is not None:
            return f"the watcher cannot follow the directory: {self.problem}"
        if not self.directory_valid and self.last_rejection is not None:
            first = self.last_rejection.problems[0] if self.last_rejection.problems else "?"
            return f"the directory as the watcher read it was rejected: {first}"
        if self.degraded and self.last_failure is not None:
            return f"the watcher's last pass failed: {self.last_failure['error']}"
        return ("the watcher has not loaded the directory since it was written: writes still going on there, "
                "or a slow filesystem; status shows when it is in force")

    async def _settle_and_load(self, changes: Batch, batches: asyncio.Queue[Batch], stop_event: asyncio.Event) -> Outcome | None:
        """Wait until a write in place is done and git has finished, then load and apply; None if stale or stopped."""
        await self._until_quiet(changes, batches, stop_event)
        await self._until_git_is_done(stop_event)
        while not batches.empty():  # one load covers every batch already queued
            batches.get_nowait()
        if stop_event.is_set():
            return None
        loaded = await self._load_off_loop()
        if not batches.empty():
            # More of the same burst arrived while we validated (a slow
            # checkout): that state is already stale, so don't swap it
            # in only to swap again; the next pass loads the newer one.
            return None
        return self._apply(loaded)

    async def _until_quiet(self, changes: Batch, batches: asyncio.Queue[Batch], stop_event: asyncio.Event) -> None:
        """While catalog files are being written in place, wait until none was touched for the quiet window.

        Batches that arrive meanwhile are taken here (the load after covers
        them); only a write in place restarts the wait, a rename does not.
        """
        if not _written_in_place(changes):
            return
        loop = asyncio.get_running_loop()
        quiet_until = loop.time() + self._quiet_ms / 1000
        while not stop_event.is_set():
            left = quiet_until - loop.time()
            if left <= 0:
                return
            try:
                more = await asyncio.wait_for(batches.get(), left)
            except asyncio.TimeoutError:
                return
            if _written_in_place(more):
                quiet_until = loop.time() + self._quiet_ms / 1000

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

    def status(self) -> dict[str, Any]:
        current = self.live.current
        return {
            "directory": self.directory, "version": current.version, "models": len(current),
            "swapped_at": self.swapped_at, "swaps": self.swaps, "rejections": self.rejections,
            "directory_valid": self.directory_valid,
            "last_rejection": self.last_rejection.to_dict() if self.last_rejection else None,
            # "degraded": the last reload failed for a reason no rule covers
            # (see last_failure), or the directory cannot be followed now
            # (see problem); the catalog in force is the last good one.
            "watcher": "degraded" if self.degraded or self.problem else "ok", "failures": self.failures,
            "last_failure": self.last_failure, "problem": self.problem, "followed": self.followed,
        }

    def watcher_status(self) -> dict[str, Any]:
        """The watcher's row of status' `watchers` (contracts.WatcherStatus's fields)."""
        problem = self.problem
        if problem is None and self.degraded and self.last_failure is not None:
            problem = str(self.last_failure.get("error"))
        return {"name": "catalog", "path": self.directory, "state": "degraded" if problem else "ok",
                "problem": problem, "since": self.problem_since, "failures": self.failures,
                "last_failure": self.last_failure, "applied_at": self.swapped_at}


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


def _written_in_place(changes: Batch) -> bool:
    # watchfiles reports a rename into place as `added` (and the old name as
    # `deleted`); data written into a file that stays open is `modified`.
    import watchfiles

    return any(change == watchfiles.Change.modified and is_catalog_file(os.path.basename(path))
               for change, path in changes)


def _relevant(change: object, path: str) -> bool:
    # Catalog files, and anything under a `..`-prefixed directory: Kubernetes
    # swaps a ConfigMap by re-pointing `..data`, and the *.yaml symlinks we read
    # never change themselves. Editor scratch files don't wake us.
    name = os.path.basename(path)
    return is_catalog_file(name) or f"{os.sep}.." in path
