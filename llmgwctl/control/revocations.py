"""Following `serve --node-revocations FILE`: which node tokens are refused, within two seconds of an edit.

The file lists `NODE [SERIAL]` lines (see `auth.parse_revocations`); each
good read swaps `ControlAuth.revocations` whole, and tells the controller so
it can take a revoked node's replicas out of the router at once rather than
at its node timeout. What the file does to the follower, it cannot do to the
control API: the file is opened without blocking (a FIFO renamed over it
opens and reads nothing), only a regular file is read, at most
MAX_REVOCATIONS_BYTES of it, in a worker thread. A read that fails (the file
is gone, unreadable, too big, not a list) keeps the last list in force --
removing the file or breaking it never un-revokes a node -- and is logged
once per distinct problem; the loop itself never dies of one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..aio import sleep_unless
from ..fsutil import OPEN_FLAGS, read_upto, stamp
from ..health import Failure, failure
from .auth import ControlAuth, TokenError, parse_revocations

log = logging.getLogger("llmgw.control.revocations")

# A revocation list is a line per revoked node: 1 MiB holds tens of thousands,
# and bounds what a file replaced by something huge can make serve read.
MAX_REVOCATIONS_BYTES = 1024 * 1024
# One stat a second: a revoked token is refused within about two seconds of
# the edit (one look sees it change, the next that it holds still), for one
# system call a second (inotify would miss edits made on another
# NFS client or through a ConfigMap's symlink swap; a stat sees both).
RECHECK = 1.0


class RevocationFileError(TokenError):
    """The revocation file cannot be read as a list; the message names the file and why."""


def read_bounded(path: str, limit: int = MAX_REVOCATIONS_BYTES) -> str:
    """The text of regular file `path`, at most `limit` bytes; RevocationFileError otherwise. Never blocks on open."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        raise RevocationFileError(f"{path}: cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RevocationFileError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise RevocationFileError(f"{path}: {info.st_size} bytes, more than the {limit} a revocation list may hold")
        try:
            data = read_upto(fd, limit)
        except OSError as exc:
            raise RevocationFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
        if len(data) > limit:
            raise RevocationFileError(f"{path}: grew past the {limit} bytes a revocation list may hold")
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise RevocationFileError(f"{path}: not UTF-8 text") from None


def load(path: str) -> Mapping[str, int | None]:
    """Read and parse the list (RevocationFileError, naming the file and line, when it is not one)."""
    text = read_bounded(path)
    try:
        return parse_revocations(text, origin=path)
    except TokenError as exc:
        raise RevocationFileError(str(exc)) from None


class Followed:
    """The follower's row of status' `watchers`: an operator who broke the list sees it there, not only in the log.

    A revocation that does not apply is the one failure that must not pass
    unseen: the token it meant to refuse keeps working.
    """

    def __init__(self, path: str, wall: Callable[[], float] = time.time):
        self.path, self._wall = path, wall
        self.problem: str | None = None
        self.since: float | None = None
        self.failures = 0
        self.last_failure: Failure | None = None
        self.applied_at: float | None = wall()      # the caller read it before following

    def failed(self, message: str) -> None:
        now = self._wall()
        self.problem, self.failures = message, self.failures + 1
        if self.since is None:
            self.since = now
        self.last_failure = failure("reading the revocation list", message, now)

    def applied(self) -> None:
        self.problem = self.since = None
        self.applied_at = self._wall()

    def status(self) -> dict[str, Any]:
        """contracts.WatcherStatus's fields."""
        return {"name": "node-revocations", "path": self.path, "state": "ok" if self.problem is None else "degraded",
                "problem": self.problem, "since": self.since, "failures": self.failures,
                "last_failure": self.last_failure, "applied_at": self.applied_at}


async def follow_revocations(auth: ControlAuth, path: str, stop: asyncio.Event,
                             on_change: Callable[[Mapping[str, int | None]], None] = lambda revoked: None,
                             recheck: float = RECHECK, followed: Followed | None = None) -> None:
    """Keep `auth.revocations` what `path` says, until `stop`. The first read is the caller's (serve refuses a bad file).

    `followed`: where each read's outcome is kept for status (`Followed.status`).
    """
    followed = followed or Followed(path)
    seen = await asyncio.to_thread(stamp, path)
    pending: tuple[int, ...] | None = None
    problem: str | None = None
    while not stop.is_set():
        await sleep_unless(recheck, stop)
        if stop.is_set():
            return
        try:
            now = await asyncio.to_thread(stamp, path)
            if now == seen:
                pending = None
                continue        # unchanged: in force, or still the problem already logged
            if now != pending:
                # Changed since the last look: read it once it holds still for one
                # look more. An editor writing in place truncates first, and the
                # empty file read then would un-revoke every node for a moment.
                pending = now
                continue
            revoked = await asyncio.to_thread(load, path)
        except RevocationFileError as exc:
            if str(exc) != problem:
                log.error("%s; the last revocation list read stays in force", exc,
                          extra={"event": "revocations-unreadable"})
                followed.failed(f"{exc}; the last revocation list read stays in force")
            problem, seen = str(exc), now
            continue
        except Exception as exc:   # a bug here must not end the follower: revocations would stop applying
            log.exception("reading the revocation list %s failed unexpectedly; trying again", path)
            followed.failed(f"{path}: reading it failed unexpectedly ({type(exc).__name__}: {exc}); trying again")
            continue
        seen, problem = now, None
        followed.applied()
        if revoked != auth.revocations:
            auth.revocations = revoked
            log.info("revocation list %s: %d node(s) listed", path, len(revoked), extra={"event": "revocations-read"})
            on_change(revoked)
