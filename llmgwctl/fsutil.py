"""The files llmgw writes and the files it follows, handled so that no file can hang, flood or stall it.

    write_atomically   readers see the old content or the new, never half of it
    read_regular       a followed file's bytes: regular files only, size-capped, never blocking on open
    off_loop           blocking work on a daemon thread, given up after a time bound
    FollowedFile       one file followed for the process's life: read and parsed off the loop, applied on
                       it, supervised (every failure counted, logged and shown; the last good content stays)

Shared by the agent (its replica records), `catalog apply` (catalog files the
watcher reads) and the router (its API key file and static endpoint file).
Whoever can write a followed file's directory can put anything there: a FIFO
(an open for reading waits for a writer for ever), a link to /dev/zero (a read
that never ends), a 30 MB file (seconds of parsing), or nothing at all. None
of those may stall the event loop, kill the follower, or keep a later valid
edit -- a revoked API key -- from taking effect. The catalog loader has its own
reader (`catalog.loader.read_file`) with the same rules plus one of its own:
links must stay inside the catalog directory.

This module imports nothing of ours but `aio` and `health`, so any piece may use it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import stat
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from .aio import cancel_and_wait, follow_file, sleep_unless
from .health import Failure, failure

T = TypeVar("T")

log = logging.getLogger("llmgw.files")

# How often a followed file is looked at even when no event came: a change
# inotify cannot report (a Kubernetes Secret's `..data` link swapped beside
# the file, a link retargeted into another directory, an NFS client's edit, a
# watch that could not be armed) is then in force within this long. A look is
# one stat when nothing changed; a second is what "a revoked key is revoked
# within seconds" needs and costs nothing a process would notice.
RECHECK = 1.0
# One read and parse of a followed file may take this long before it is given
# up and reported. A file within its size cap reads and parses in well under a
# second; past 10 s the filesystem is hung (a dead NFS server, a stuck FUSE
# mount), and waiting longer would only hide that from status.
READ_TIMEOUT = 10.0
# The longest problem text status and logs carry for one file: enough for every
# line of a key file's errors, never a file's worth of text.
MAX_PROBLEM = 2000


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Temp file in the same directory (hidden, so watchers skip it), fsync, rename over, fsync the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # The rename is durable only once the directory entry is.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- reading -------------------------------------------------------------------------

class UnusableFile(Exception):
    """A followed file cannot be read as one; the message names the file and why."""


class MissingFile(UnusableFile):
    """The file (or what its link points at) does not exist."""


# How a followed file is opened: never blocking on a FIFO swapped in after the
# stat, never becoming the controlling terminal, never inherited by a child.
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


def read_upto(fd: int, max_bytes: int) -> bytes:
    """What `fd` holds, read until its end or past `max_bytes` (at most max_bytes + 1 bytes: more says it grew)."""
    chunks, size = [], 0
    while size <= max_bytes:
        chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words an operator recognises."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB"


def read_regular(path: str | os.PathLike[str], max_bytes: int, what: str = "file") -> bytes:
    """The bytes of `path` if it is a regular file of at most `max_bytes`; UnusableFile saying why not.

    Blocking (a read from disk): call it from a thread (`off_loop`). What it
    promises whatever sits at `path`:
    - a symlink is followed (Kubernetes mounts Secrets and ConfigMaps as
      links, config managers link files into place), so O_NOFOLLOW is not
      used; what it resolves to must be a regular file, checked before the
      open (a device is never opened, a FIFO never waited on) and again on
      the open descriptor (a swap in between is caught);
    - the open is O_NONBLOCK, so even a FIFO renamed in between the two
      checks cannot hold it: opening a FIFO for reading without a writer
      waits for one for ever otherwise;
    - nothing past `max_bytes` + 1 is read: a file that grew past the cap
      while being read is refused too, never parsed in part.
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise MissingFile(f"{path}: is a symlink to {target!r}, which does not exist") from None
        raise MissingFile(f"{path}: does not exist") from None
    except OSError as exc:
        raise UnusableFile(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnusableFile(f"{path}: is {file_kind(st.st_mode)}, not a regular file; only regular files are read")
    if st.st_size > max_bytes:
        raise UnusableFile(f"{path}: is {st.st_size} bytes, more than the {_mib(max_bytes)} allowed for the "
                           f"{what}; not read")
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        raise MissingFile(f"{path}: disappeared while being read") from None
    except OSError as exc:
        raise UnusableFile(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnusableFile(f"{path}: was replaced by {file_kind(mode)} while being read; "
                               "only regular files are read")
        data = read_upto(fd, max_bytes)
        if len(data) > max_bytes:
            raise UnusableFile(f"{path}: grew past the {_mib(max_bytes)} allowed for the "
                               f"{what} while being read; not used")
        return data
    except OSError as exc:
        raise UnusableFile(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def stamp(path: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """What changes when the file at `path` (through its links) changes in any way; None if there is none.

    The inode and device (a rename over it, a link retargeted), size and
    mtime (a write), ctime (a chmod, a rename), the mode (a FIFO in its place).
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


async def off_loop(fn: Callable[[], T], timeout: float, name: str) -> T:
    """`fn()` on a daemon thread; TimeoutError after `timeout` seconds.

    Not `asyncio.to_thread`: the default executor's threads are joined at
    exit, so one stuck in a read on a hung filesystem would keep the process
    from ever exiting on SIGTERM, and it has a bounded number of threads that
    hung reads would use up. A thread given up on is left to finish alone;
    callers hold a lock in `fn` so they never start a second one behind it.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(method: str, value: object) -> None:
        if not done.done():
            getattr(done, method)(value)

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the loop, which raises it in the caller
            loop.call_soon_threadsafe(settle, "set_exception", exc)
        else:
            loop.call_soon_threadsafe(settle, "set_result", result)

    threading.Thread(target=work, name=name, daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout)
    except asyncio.TimeoutError:
        if done.done():     # `fn`'s own TimeoutError, or its answer in the very moment the bound ran out
            return done.result()
        raise TimeoutError(f"took longer than {timeout:g} s") from None


# -- following -----------------------------------------------------------------------

class FollowedFile(Generic[T]):
    """One file followed for the process's life: every usable state of it is applied, nothing else.

    `parse(bytes) -> T` runs with the read, off the loop; `apply(T)` on the
    loop, with each new valid content. A content `parse` refuses (raising
    `rejects`), a file that is not a regular file, too big, missing,
    unreadable or hung: each is counted, logged once when it starts, and shown
    by `status()` (`degraded` with the problem) while the last good content
    stays in force. The next usable state is applied whatever came before.

    What wakes a look: an event in the file's directory (read again, always),
    and every `recheck` seconds a stat that reads again only if the file
    changed (or the last look failed for a reason that may pass, such as a
    read that timed out). Anything a look raises that no rule expected is
    counted and logged with its traceback, and the follower goes on.

    `load()` and `reload()` are the blocking one-pass entry points (start-up,
    tests); `check()` is the one pass on the loop; `run()` only calls it.
    """

    task: asyncio.Task[None]      # once started (`start`)

    def __init__(self, path: str | os.PathLike[str], *, name: str, what: str, parse: Callable[[bytes], T],
                 apply: Callable[[T], None], rejects: type[Exception], max_bytes: int,
                 keeping: str = "keeping the last good content in force",
                 on_result: Callable[[str], None] = lambda result: None,
                 recheck: float = RECHECK, read_timeout: float = READ_TIMEOUT,
                 wall_clock: Callable[[], float] = time.time):
        self.path = os.path.abspath(os.fspath(path))
        self.name, self.what, self.keeping = name, what, keeping
        self._parse, self._apply, self._rejects = parse, apply, rejects
        self._max_bytes, self._recheck, self._timeout = max_bytes, recheck, read_timeout
        self._on_result = on_result
        self._wall = wall_clock
        # One read at a time, across threads: a read given up on (hung) still
        # holds it, so no second thread piles up behind it. On the loop, one
        # look at a time, so an older look never applies over a newer one.
        self._reading = threading.Lock()
        self._looking: asyncio.Lock | None = None
        self._seen: tuple[int, ...] | None = None     # the stamp of the last look that needs no repeat
        self.problem: str | None = None              # why the file is not in force now; None when it is
        self.problem_since: float | None = None
        self.failures = 0
        self.last_failure: Failure | None = None
        self.applied = 0
        self.applied_at: float | None = None

    @property
    def last_error(self) -> str | None:
        return self.problem

    # -- one pass ----------------------------------------------------------------

    def load(self) -> T:
        """Read and parse the file now (blocking); UnusableFile or `rejects` if it cannot be used."""
        data = read_regular(self.path, self._max_bytes, self.what)
        return self._parse(data)

    def load_initial(self) -> T:
        """Read, parse and apply now (blocking); the `rejects` error if the file cannot be used.

        At start there is no last good content to keep, so an unusable file is
        the caller's to refuse (a router does not start without its keys).
        """
        before = stamp(self.path)
        try:
            value = self.load()
        except UnusableFile as exc:
            raise self._rejects(str(exc)) from None
        self._apply(value)
        self._seen, self.applied_at = before, self._wall()
        return value

    def _read(self, force: bool) -> tuple[tuple[int, ...] | None, T | None, Exception | None] | None:
        """On the worker thread: (stamp before the read, value, why it is unusable), or None if unchanged."""
        if not self._reading.acquire(blocking=False):
            raise TimeoutError(f"an earlier read has not finished after {self._timeout:g} s; is its filesystem hung?")
        try:
            before = stamp(self.path)
            if not force and before is not None and before == self._seen:
                return None
            try:
                return before, self.load(), None
            except Exception as exc:  # noqa: BLE001 -- sorted by _failed: a refusal, or what no rule expected
                return before, None, exc
        finally:
            self._reading.release()

    def reload(self) -> bool:
        """One blocking pass: read, parse, apply. True if the file's content is in force afterwards."""
        try:
            return self._took(self._read(force=True))
        except Exception as exc:  # noqa: BLE001 -- supervised: a bug in applying must not end the caller
            self._failed(exc, None)
            return False

    async def check(self, force: bool = True) -> bool:
        """One pass on the loop, the read and parse off it. True if the file's content is in force afterwards.

        `force`: read again even if the file looks unchanged (an event said it
        changed, or what parsing depends on did). Never raises but on cancel.
        """
        if self._looking is None:
            self._looking = asyncio.Lock()
        async with self._looking:
            try:
                got = await off_loop(lambda: self._read(force), self._timeout, f"read {self.name}")
            except TimeoutError as exc:
                self._failed(TimeoutError(f"reading it {exc}; is its filesystem hung?")
                             if "earlier read" not in str(exc) else exc, None)
                return False
            try:
                return self._took(got)
            except Exception as exc:  # noqa: BLE001 -- supervised: a bug in applying must not end the follower
                self._failed(exc, None)
                return False

    def _took(self, got: tuple[tuple[int, ...] | None, T | None, Exception | None] | None) -> bool:
        if got is None:
            return self.problem is None
        seen, value, refused = got
        if refused is not None:
            # A problem of this very state of the file: not read again until it changes.
            self._failed(refused, seen)
            return False
        self._apply(cast(T, value))
        self._seen = seen
        self.applied += 1
        self.applied_at = self._wall()
        self._on_result("applied")
        if self.problem is not None:
            log.info("%s: usable again, in force", self.path, extra={"event": f"{self.name}-recovered"})
        self.problem = self.problem_since = None
        return True

    def _failed(self, exc: BaseException, seen: tuple[int, ...] | None) -> None:
        """Record why the file is not in force. Counted and logged once per problem, not once per look.

        `seen`: the stamp the problem belongs to, so an unchanged file is not
        read again for nothing; None for a problem that may pass by itself (a
        hung read, a bug), which the next look tries again.
        """
        expected = isinstance(exc, (UnusableFile, self._rejects, TimeoutError))
        message = str(exc) if isinstance(exc, (UnusableFile, self._rejects)) else f"{self.path}: {exc}"
        if not expected:
            message = f"{self.path}: reading it failed unexpectedly ({type(exc).__name__}: {exc})"
        message = message[:MAX_PROBLEM]
        self._seen = seen
        if message == self.problem:
            return
        now = self._wall()
        self.problem, self.failures = message, self.failures + 1
        if self.problem_since is None:
            self.problem_since = now
        self.last_failure = failure(f"reading {self.what}", message, now)
        self._on_result("rejected")
        if expected:
            log.error("%s not used; %s:\n  %s", self.what, self.keeping, message.replace("\n", "\n  "),
                      extra={"event": f"{self.name}-rejected"})
        else:
            log.error("%s: following it failed; %s, and it is followed on:\n%s", self.path, self.keeping,
                      "".join(traceback.format_exception(exc)).rstrip(), extra={"event": f"{self.name}-failed"})

    # -- the loop ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the file until `stop` is set. Never raises but on cancel."""
        async def rechecks() -> None:
            while not await sleep_unless(self._recheck, stop):
                await self.check(force=False)

        ticker = asyncio.get_running_loop().create_task(rechecks(), name=f"{self.name}-recheck")
        unwatched: str | None = None
        try:
            while not stop.is_set():
                try:
                    async for _ in follow_file(self.path, stop):
                        await self.check(force=True)
                except Exception as exc:  # noqa: BLE001 -- the directory went, inotify ran out: the rechecks go on
                    why = f"{type(exc).__name__}: {exc}"
                    if why != unwatched:
                        log.warning("%s: its directory cannot be watched (%s); looking at it every %g s instead",
                                    self.path, why, self._recheck)
                    unwatched = why
                else:
                    unwatched = None
                await sleep_unless(self._recheck, stop)    # the watch ended without `stop`: arm it again, not at once
        finally:
            await cancel_and_wait(ticker)

    def start(self, stop: asyncio.Event) -> asyncio.Task[None]:
        """`run(stop)` as a task of the running loop (kept as `.task`)."""
        self.task = asyncio.get_running_loop().create_task(self.run(stop), name=self.name)
        return self.task

    def status(self) -> dict[str, Any]:
        """This follower's row of status' `watchers` (contracts.WatcherStatus's fields)."""
        return {"name": self.name, "path": self.path, "state": "ok" if self.problem is None else "degraded",
                "problem": self.problem, "since": self.problem_since, "failures": self.failures,
                "last_failure": self.last_failure, "applied_at": self.applied_at}
