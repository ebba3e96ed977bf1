"""`catalog apply`: validate a file as part of the directory, plan what it changes, write it atomically.

Applying never swaps a catalog itself. It writes the file into the catalog
directory (temp file + rename, so the directory never holds half a file) and
lets the watcher take it like any other edit: one path for every change.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

from .. import fsutil
from ..catalog import Catalog, CatalogError, Problem, load_dir
from ..catalog.diff import diff
from ..catalog.loader import is_catalog_file
from .errors import ControlError

log = logging.getLogger("llmgw.control")


class ApplyError(ControlError, ValueError):
    """The request itself is wrong (not the catalog): a bad file name, an empty body."""


# The names `catalog apply` may write: 1-100 ASCII letters, digits, dots,
# underscores and dashes, starting with a letter or digit, ending .yaml or .yml.
# A name is shown in `status`, in events and in error messages, and becomes a
# path: a NUL, a newline or a bidi override (U+202E: `lmay.x` that reads
# `x.yaml`) has no place in it, a directory separator or a leading dot would
# put the file outside the catalog or hide it, and 100 characters is past any
# real name while staying far below a file system's 255 bytes. Files put in
# the directory by other means (git, an editor) are read whatever their name.
FILENAME_RULE = ("1-100 of the characters A-Z a-z 0-9 . _ -, starting with a letter or digit and ending "
                 ".yaml or .yml (no directory, no hidden file)")
_FILENAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def filename_problem(filename: object) -> str | None:
    """Why `filename` is not a name `catalog apply` writes, naming the rule; None when it is one.

    The server is the authority; the CLI asks the same before sending.
    """
    if not isinstance(filename, str):
        return f"filename must be a string, not {type(filename).__name__}"
    if _FILENAME.fullmatch(filename) is None or not is_catalog_file(filename):
        shown = filename if len(filename) <= 60 else filename[:60] + "..."
        return f"filename {shown!r} is not a catalog file name: use {FILENAME_RULE}"
    return None


def check_filename(filename: str) -> str:
    problem = filename_problem(filename)
    if problem is not None:
        raise ApplyError(problem)
    return filename


def decode_content(content: str) -> bytes:
    """The UTF-8 bytes of a posted document; ApplyError for text JSON allows but UTF-8 cannot hold (a lone surrogate)."""
    try:
        return content.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApplyError(f"content is not valid Unicode text: {exc.reason} at character {exc.start}") from None


def validate_with(directory: str, filename: str, content: bytes) -> Catalog:
    """The catalog `directory` would hold with `filename` set to `content`; CatalogError naming real paths.

    The directory is read as the watcher reads it (same limits, same refusal
    of FIFOs and links out of it), with `content` in place of the file, so
    nothing is copied and a FIFO in the directory cannot block the copy.
    """
    name = check_filename(filename)
    try:
        return load_dir(directory, replace={name: content})
    except CatalogError:
        raise
    except Exception as exc:  # a bug in a rule must answer 422 with a reason, not a bare 500
        log.exception("validating %s for catalog apply failed unexpectedly", name)
        raise CatalogError([Problem(os.path.join(directory, name), (),
                                    f"could not be validated ({type(exc).__name__}: {str(exc)[:200]}); "
                                    "this is a bug in llmgw, the server log has the traceback")]) from None


def write_atomically(directory: str, filename: str, content: bytes) -> str:
    name = check_filename(filename)
    final = os.path.join(directory, name)
    fsutil.write_atomically(final, content)
    return final


class ApplyQueue:
    """Applies one at a time, and at most `size` of them held (the one in its turn and those waiting).

    Validating a large directory holds its parsed documents and rules' state
    in memory, several times the file's size: applies validated side by side
    each held their own, so memory grew with how many were sent at once, not
    with the catalog. One at a time bounds it by one. It also makes two
    applies that race come out as if sent one after the other: the second is
    validated with the first's file in the directory and planned against the
    catalog the first put in force. A second apply waits rather than being
    refused: two `catalog apply` runs of a script or a CI job are both meant
    to happen, and one validation is seconds. The wait is bounded by the
    caller, and so is the queue, since each waiter holds its body.
    """

    def __init__(self, size: int):
        self.size = size
        self.held = 0
        self._turn = asyncio.Lock()     # FIFO: applies take their turns in the order they came

    def full(self) -> bool:
        return self.held >= self.size

    @contextlib.contextmanager
    def held_one(self) -> Iterator[None]:
        """Count one apply as held (body read, waiting or in its turn) while inside."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1

    @contextlib.asynccontextmanager
    async def turn(self, timeout: float) -> AsyncIterator[None]:
        """This apply's turn, waited for at most `timeout` seconds (asyncio.TimeoutError past it)."""
        await asyncio.wait_for(self._turn.acquire(), timeout)
        try:
            yield
        finally:
            self._turn.release()


def plan(current: Catalog, new: Catalog, preview: dict[str, Any]) -> dict[str, Any]:
    return {"from_version": current.version, "to_version": new.version, "diff": diff(current, new).to_dict(),
            "replicas": preview}
