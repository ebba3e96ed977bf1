"""Keeping an endpoint out of picks for a while, for a cause, with the reason said.

A refused or reset connection is a blip: the balancer ejects for a second,
doubling while it repeats, and forgets at the next success
(`Balancer.eject`). An engine that broke a bound the router holds every peer
to -- an answer past the cap, headers without end, a redirect -- is broken
or hostile and will do it again, so `Ejector` keeps it out longer and keeps
*why*, which the router reports (status rows, `/metrics`) so an operator sees
which replica misbehaves and how, without reading logs.

Each ejection is `(code, reason, until)`: `code` is a bounded name fit for a
metric label, `reason` a sentence for a person. Anything that decides an
endpoint should rest -- this router's bounds today, outlier detection on
consecutive failures later -- can call `eject`; the pick sees only the
balancer's `ejected_until`, so a new cause needs no change to it.

It must not know about HTTP or engines: it is told an endpoint, a code and a reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .balancer import Balancer, EndpointState

# The first ejection for a cause: long enough that the burst of requests
# behind a bad answer all go elsewhere, short enough that an engine restarted
# or fixed gets traffic back within a minute. Doubled while the endpoint keeps
# misbehaving, up to CAP: an engine answering every request with 10 GB costs
# one request per 10 minutes once it has shown it means it; the controller,
# not the router, is what replaces it.
BASE = 30.0
CAP = 600.0


@dataclass(frozen=True, slots=True)
class Ejection:
    code: str           # what was broken, a bounded name (answer_too_large, headers_too_large, redirect, ...)
    reason: str         # the same for a person: what the engine did
    until: float        # on the balancer's clock
    seconds: float      # how long it was ejected for
    strikes: int        # ejections in a row, each less than CAP after the last one ran out

    def describe(self) -> str:
        """One line for status: why, and for how long. No countdown: the line changes only when the ejection does."""
        return f"ejected by the router for {self.seconds:.0f} s: {self.reason}"


class Ejector:
    """Ejections for cause of a balancer's endpoints, by replica id; `current()` is what is in force."""

    def __init__(self, balancer: Balancer, *, clock: Callable[[], float] = time.monotonic,
                 base: float = BASE, cap: float = CAP):
        self._balancer = balancer
        self._clock = clock
        self.base = base
        self.cap = cap
        # replica id -> (the state ejected, its ejection). The state is kept so
        # a replica that came back under a new URL (a new EndpointState) is
        # not shown as ejected: the balancer's new state never was.
        self._held: dict[str, tuple[EndpointState, Ejection]] = {}

    def eject(self, state: EndpointState, code: str, reason: str) -> Ejection:
        """Keep `state` out of picks for BASE, doubled per strike up to CAP; return the ejection."""
        now = self._clock()
        last = self._held.get(state.replica_id)
        # Another strike when the last ejection ended less than CAP ago: a
        # replica that behaved for that long starts afresh.
        strikes = last[1].strikes + 1 if last is not None and last[0] is state and now < last[1].until + self.cap \
            else 1
        duration = min(self.base * 2 ** (strikes - 1), self.cap)
        ejection = Ejection(code, reason, now + duration, duration, strikes)
        self._held[state.replica_id] = (state, ejection)
        self._balancer.keep_out(state, ejection.until)
        return ejection

    def current(self) -> dict[str, Ejection]:
        """{replica id: its ejection} for endpoints listed now and still out; older records are dropped."""
        if not self._held:
            return {}
        now = self._clock()
        out: dict[str, Ejection] = {}
        for rid, (state, ejection) in list(self._held.items()):
            if self._balancer.state_of(rid) is not state or now >= ejection.until + self.cap:
                del self._held[rid]     # gone, replaced, or long enough back in service to start afresh
            elif now < ejection.until:
                out[rid] = ejection
        return out
