"""One request the router answered, as the request log keeps it (router -> controller -> console, CLI).

The router makes one `RequestRecord` per request it answers, where it counts
and logs it (`router.accounting`), and hands it to a `RequestSink`: in `serve`
the controller's request log and traffic history (`control.requestlog`,
`control.history`). A standalone router sends its records with its usage
report (`UsageReport.requests`, the `to_dict` form below), which the
controller checks with `from_dict` like any other payload of another process.

    {"at": 1733150000.12,            # wall clock of the request's end (seconds)
     "id": "9f2c...",                # the request id the client got (X-Request-Id)
     "key": "team-search",           # the API key's *name*, never the key; null: the router is open
     "asked": "qwen",                # the model name the body gave (an alias, say); "" when none could be read
     "model": "qwen2.5-7b-instruct", # the model that served it, canonical; "" when none was resolved
     "status": 200, "path": "/v1/chat/completions", "stream": true,
     "ttft": 0.132,                  # seconds to the first body byte (a whole answer: to its end); null: none sent
     "duration": 1.91,
     "tokens_in": 31, "tokens_out": 220,   # from the engine's usage block; null: it sent none
     "replica": "r-7",               # the replica that answered; "" when the router answered itself
     "error": null}                  # for a refusal or a failure, why (the error message the client got)

Every text is bounded (MAX_TEXT, MAX_ERROR) so a record stays a few hundred
bytes: the log holds thousands of them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from .errors import UsageError

# Ids, names and paths past this are cut: a request id is at most 128
# characters (router.headers), model and key names far less.
MAX_TEXT = 200
# An error message as the client got it can be long (a "did you mean" list); the log keeps its start.
MAX_ERROR = 500
# A status outside HTTP's range is no status.
_STATUS = range(100, 1000)
# Seconds on the wire: a day is longer than any request the router lets run.
MAX_SECONDS = 86400.0
MAX_TOKENS = 10**9


class RequestRecord(NamedTuple):
    """One request as the log keeps it (the module docstring has the fields). A tuple, not a frozen
    dataclass: the router makes one per request, and a tuple is made in a tenth of the time."""

    at: float
    id: str
    key: str | None
    asked: str
    model: str
    status: int
    path: str = ""
    stream: bool = False
    ttft: float | None = None
    duration: float = 0.0
    tokens_in: int | None = None
    tokens_out: int | None = None
    replica: str = ""
    error: str | None = None

    @property
    def failed(self) -> bool:
        """An error of the service's (5xx): what a chart of errors counts. 4xx are the client's."""
        return self.status >= 500

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "id": self.id, "key": self.key, "asked": self.asked, "model": self.model,
                "status": self.status, "path": self.path, "stream": self.stream, "ttft": self.ttft,
                "duration": self.duration, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "replica": self.replica, "error": self.error}

    @classmethod
    def from_dict(cls, d: Any) -> RequestRecord:
        """UsageError naming the field when `d` is not a record (from a standalone router's report)."""
        if not isinstance(d, Mapping):
            raise UsageError("a request record must be an object")
        try:
            return cls(at=_seconds(d.get("at"), "at", 1e12), id=_text(d.get("id"), "id"),
                       key=None if d.get("key") is None else _text(d.get("key"), "key"),
                       asked=_text(d.get("asked", ""), "asked"), model=_text(d.get("model", ""), "model"),
                       status=_status(d.get("status")), path=_text(d.get("path", ""), "path"),
                       stream=d.get("stream") is True,
                       ttft=None if d.get("ttft") is None else _seconds(d.get("ttft"), "ttft"),
                       duration=_seconds(d.get("duration", 0.0), "duration"),
                       tokens_in=_tokens(d.get("tokens_in"), "tokens_in"),
                       tokens_out=_tokens(d.get("tokens_out"), "tokens_out"),
                       replica=_text(d.get("replica", ""), "replica"),
                       error=None if d.get("error") is None else _text(d.get("error"), "error", MAX_ERROR))
        except ValueError as exc:
            raise UsageError(f"bad request record: {exc}") from None


class RequestSink(Protocol):
    """Where the router hands each request it answered: the router depends on this, not on the control
    plane, so the controller's log, a standalone router's outbox and a test's list all fit. Called on the
    router's loop once per request: it must only append."""

    def record(self, rec: RequestRecord) -> None: ...


def cut(text: str, limit: int = MAX_TEXT) -> str:
    """`text` within `limit` characters (what the router itself puts in a record)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _text(v: Any, name: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{name} must be a string")
    return cut(v, limit)


def _status(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v not in _STATUS:
        raise ValueError(f"status must be an HTTP status, not {str(v)[:20]!r}")
    return v


def _seconds(v: Any, name: str, high: float = MAX_SECONDS) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= high):
        raise ValueError(f"{name} must be seconds from 0 to {high:g}")
    return float(v)


def _tokens(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKENS:
        raise ValueError(f"{name} must be a count from 0 to {MAX_TOKENS}")
    return v
