"""Retries before the first byte: which failed attempts may go to another replica, and each request's budget.

A request is sent again, to a replica not tried yet, only after a failure
that cannot have put a byte of an answer in front of the client:

    the connection refused, failed or reset before any byte came back  ConnectFailed
    the connection cut before the answer's headers were complete       UpstreamBroken from `post`
    no complete headers in time (or, for a stream, silence before them) UpstreamTimeout from `post`
    an answer of 502 or 503 from the engine (a proxy in front of it
    that lost it, an engine overloaded or still loading)               `RETRY_STATUSES`
    the replica ejected for not answering while the headers were
    awaited (a wedged engine; moved at once, inflight.py)              `Failure.ABANDONED`

Not after the answer path took the engine's answer: from then on the client
may have bytes of it (a stream's headers go out as soon as the engine's come
in), and a second answer would follow the first. A cut stream is the
continuation's (continuation.py), never this module's. Not for an engine
that broke a bound (OutOfBounds: a hostile or broken engine's answer, kept
out for a while and answered 502 as such), nor for any other status: a 500
or a 4xx is the engine's verdict on the request, which another replica
would repeat.

`Attempts` is one request's budget (`--max-attempts`) and what each attempt
came to; the request path's attempts (dispatch.py) ask it whether they may
go on and put its count in the access log and the `x-llmgw-attempts`
header. It must
not know the balancer, HTTP or the catalog.
"""
from __future__ import annotations

from typing import Protocol

from .upstream import ConnectFailed, OutOfBounds, UpstreamError, UpstreamTimeout

__all__ = ["ATTEMPTS_HEADER", "RETRY_STATUSES", "Attempts", "Failure", "retryable", "retryable_status"]

# The response header that says how many replicas were tried for the answer.
ATTEMPTS_HEADER = "x-llmgw-attempts"
# 502: a proxy in front of the engine found it gone; 503: the engine is
# loading, overloaded or shutting down. Neither ran the request, and another
# replica may well answer it. 504 is not here: a gateway timeout in front of
# an engine may come after the request ran there for minutes.
RETRY_STATUSES = frozenset({502, 503})


def retryable(exc: UpstreamError) -> bool:
    """Whether `exc`, raised while the request was sent and before its answer's headers were in, may go elsewhere."""
    return not isinstance(exc, OutOfBounds)


def retryable_status(status: int) -> bool:
    """Whether an engine's answer with `status` may be dropped for another replica's, before a byte of it is sent."""
    return status in RETRY_STATUSES


class Replica(Protocol):
    """What an attempt is made at: only its id is read here (the balancer's EndpointState is one)."""

    @property
    def replica_id(self) -> str: ...


class Failure:
    """What one failed attempt came to: the replica, why, and which kind of failure (`UNREACHED` ...).

    The kind is also the `reason` label of llmgw_router_retries_total.
    """

    __slots__ = ("replica", "reason", "kind")

    # The engine could not be reached (refused, reset before any byte): it is
    # down, which a request may wait out as a cold start (the request path's call).
    UNREACHED = "unreached"
    # No complete headers in time: the last one is answered 504, as a gateway timeout.
    TIMED_OUT = "timed_out"
    # The connection cut after some bytes of the head, before it was complete.
    HEADERS_CUT = "headers_cut"
    # An answer of 502 or 503 (`RETRY_STATUSES`).
    REFUSED = "refused"
    # Its replica left the routing for not answering while the headers were
    # awaited (router/inflight.py): moved at once, not after the headers timeout.
    ABANDONED = "abandoned"

    def __init__(self, replica: str, reason: str, kind: str):
        self.replica = replica
        self.reason = reason
        self.kind = kind

    @classmethod
    def of(cls, replica: str, exc: UpstreamError) -> Failure:
        kind = cls.UNREACHED if isinstance(exc, ConnectFailed) else \
            cls.TIMED_OUT if isinstance(exc, UpstreamTimeout) else cls.HEADERS_CUT
        return cls(replica, f"{exc or type(exc).__name__}", kind)

    def __str__(self) -> str:
        return f"{self.replica}: {self.reason}"


class Attempts:
    """One request's attempts: at most `budget`, each at a replica not tried before; what each failed one said."""

    __slots__ = ("budget", "count", "failures")

    def __init__(self, budget: int):
        self.budget = max(1, budget)
        self.count = 0
        self.failures: list[Failure] = []

    def start(self) -> int:
        """An attempt begins; returns its number (1 for the first)."""
        self.count += 1
        return self.count

    def failed(self, failure: Failure) -> None:
        self.failures.append(failure)

    @property
    def left(self) -> int:
        """Attempts the budget still allows."""
        return self.budget - self.count

    def grant(self) -> None:
        """One attempt more than the budget leaves, if none is left: for a replica that joined while the
        request waited (after every one it tried was down), which must get its try."""
        if self.left <= 0:
            self.budget = self.count + 1

    def unreached_only(self) -> bool:
        """Whether every attempt so far found its engine down (nothing answered, nothing timed out)."""
        return bool(self.failures) and all(f.kind == Failure.UNREACHED for f in self.failures)

    def summary(self) -> str:
        """Each failed attempt, in order: what an error after the last one says."""
        n = len(self.failures)
        said = "; ".join(str(f) for f in self.failures) or "no endpoint left to try"
        return said if n <= 1 else f"{n} attempts: {said}"
