"""The request log: the last requests the routers answered, for the console and `llmgwctl logs --requests`.

    GET /api/v1/requests[?model=M&status=S&id=ID&limit=N]
        {"capacity": 2000, "total": 48213, "requests": [RequestRecord..., newest first]}

`model` matches the name asked or the model that served; `status` is a code
(`503`), a class (`5xx`, `4xx`) or `error` (any 4xx or 5xx); `id` a request
id or its start. Records come from the in-process router (`Router.set_request_sink`)
and from standalone routers' usage reports (`UsageReport.requests`).

Bounded: a ring of CAPACITY records, a few hundred bytes each, so the log is
a few MB at most and what a query walks is bounded too. Nothing is written to
disk: the access log (`llmgw.access`) is what keeps requests for good.

It must not know where records come from or who reads them.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..contracts import ContractError, RequestRecord
from .errors import ControlError

# Requests kept: a few minutes of a busy gateway, hours of a quiet one, ~1 MB.
CAPACITY = 2000
# Records one answer carries unless asked for more (a screenful and then some).
DEFAULT_LIMIT = 200
# Records taken from one standalone router's report: its outbox's size (router.watch.OUTBOX).
MAX_REPORTED = 1000


class QueryError(ControlError):
    """A request log query the log cannot answer; the message names the parameter."""


def status_filter(status: str | None) -> Callable[[int], bool] | None:
    """A test of a record's status for `status` ("503", "5xx", "error"); None: no filter. QueryError if not one."""
    if not status:
        return None
    s = status.strip().lower()
    if s == "error":
        return lambda code: code >= 400
    if len(s) == 3 and s[0] in "12345" and s[1:] == "xx":
        hundreds = int(s[0])
        return lambda code: code // 100 == hundreds
    if s.isdigit() and len(s) == 3:
        wanted = int(s)
        return lambda code: code == wanted
    raise QueryError(f"status must be a code (503), a class (5xx) or 'error', not {status[:20]!r}")


class RequestLog:
    """A ring of the last `capacity` records; `record` is a RequestSink (called per request: append only)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._ring: collections.deque[RequestRecord] = collections.deque(maxlen=capacity)
        self.total = 0          # records ever taken, so a reader sees how many the ring has let go
        self.listeners: list[Callable[[RequestRecord], None]] = []    # told of each record (control.history)

    def record(self, rec: RequestRecord) -> None:
        self._ring.append(rec)
        self.total += 1
        for listener in self.listeners:
            listener(rec)

    def extend(self, records: Iterable[RequestRecord]) -> None:
        for rec in records:
            self.record(rec)

    def take_reported(self, raw: Any) -> int:
        """A standalone router's `requests` (its usage report's): each record checked, the bad ones dropped.

        Returns how many were dropped. A router holds the agent token, so what
        it says of its requests is taken as said, bounded (MAX_REPORTED a
        report, every field by `RequestRecord.from_dict`).
        """
        if not isinstance(raw, list):
            return 0
        dropped = max(0, len(raw) - MAX_REPORTED)
        for item in raw[:MAX_REPORTED]:
            try:
                self.record(RequestRecord.from_dict(item))
            except ContractError:
                dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._ring)

    def newest(self) -> Iterator[RequestRecord]:
        return reversed(self._ring)

    def query(self, *, model: str | None = None, status: str | None = None, request_id: str | None = None,
              limit: int = DEFAULT_LIMIT) -> list[RequestRecord]:
        """The newest records that match every filter given, at most `limit` (QueryError for a bad status)."""
        test = status_filter(status)
        limit = max(0, min(limit, self.capacity))
        out: list[RequestRecord] = []
        for rec in reversed(self._ring):
            if len(out) >= limit:
                break
            if model and rec.model != model and rec.asked != model:
                continue
            if request_id and not rec.id.startswith(request_id):
                continue
            if test is not None and not test(rec.status):
                continue
            out.append(rec)
        return out
