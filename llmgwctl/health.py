"""A supervised loop's last failure, the one record every loop keeps and status shows.

    Failure    {"at": wall-clock seconds, "what": what was being done, "error": why it failed}
    failure    build one; `error_text` says an exception the same way everywhere

The catalog watcher, the followed files (`fsutil.FollowedFile`: API keys,
endpoints; `control.revocations.Followed` for the node revocation list) and
the reconciler each keep their last failure in this shape, and `contracts.status` passes it on as it is, so the status
page, `llmgwctl status` and the console read one spelling. This module
imports nothing of ours, so any piece may use it.
"""
from __future__ import annotations

from typing import TypedDict

# The longest exception text a failure carries: a line or two of why, never a
# document's worth (a parser may quote its whole input).
MAX_ERROR = 500


class Failure(TypedDict):
    at: float
    what: str
    error: str


def failure(what: str, error: str, at: float) -> Failure:
    """The record of a failure of `what` at wall-clock time `at`, with `error` as the caller bounded it."""
    return {"at": at, "what": what, "error": error}


def error_text(exc: BaseException) -> str:
    """`TypeName: message` of an unexpected exception, at most MAX_ERROR characters."""
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR]
