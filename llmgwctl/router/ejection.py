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
endpoint should rest -- this router's bounds, outlier detection on
consecutive missed polls (outlier.py) -- can call `eject`; the pick sees only
the balancer's `ejected_until`, so a new cause needs no change to it.

An ejection is either timed (out until `until`, then back) or held until the
endpoint answers (`until_answered`): a wedged engine is not better for having
rested, so it stays out while it is silent, however long, and `answered()`
lets it back once it speaks -- but not before `until`, the back-off that
keeps an engine which wedges again and again out a little longer each time.

It must not know about HTTP or engines: it is told an endpoint, a code and a reason.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

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
    strikes: int        # ejections in a row, each less than the cap after the last one ran out
    until_answered: bool = False    # held past `until` while the endpoint does not answer (see answered())

    def describe(self) -> str:
        """One line for status: why, and for how long. No countdown: the line changes only when the ejection does."""
        if self.until_answered:
            return f"ejected by the router until it answers (at least {self.seconds:.0f} s): {self.reason}"
        return f"ejected by the router for {self.seconds:.0f} s: {self.reason}"


class Ejector:
    """Ejections for cause of a balancer's endpoints, by replica id; `current()` is what is in force."""

    def __init__(self, balancer: Balancer, *, clock: Callable[[], float] = time.monotonic,
                 base: float = BASE, cap: float = CAP, on_eject: Callable[[str], None] = lambda code: None):
        self._balancer = balancer
        self._clock = clock
        self.base = base
        self.cap = cap
        self._on_eject = on_eject       # told each ejection's code (a counter by reason)
        # replica id -> (the state ejected, its ejection). The state is kept so
        # a replica that came back under a new URL (a new EndpointState) is
        # not shown as ejected: the balancer's new state never was.
        self._held: dict[str, tuple[EndpointState, Ejection]] = {}

    def eject(self, state: EndpointState, code: str, reason: str, *, base: float | None = None,
              cap: float | None = None, until_answered: bool = False) -> Ejection:
        """Keep `state` out of picks for `base`, doubled per strike up to `cap` (the Ejector's own when
        None), or, `until_answered`, at least that long and then until `answered()`; return the ejection."""
        base = self.base if base is None else base
        cap = self.cap if cap is None else cap
        now = self._clock()
        last = self._held.get(state.replica_id)
        # Another strike when the last ejection ended less than `cap` ago: a
        # replica that behaved for that long starts afresh.
        strikes = last[1].strikes + 1 if last is not None and last[0] is state and now < last[1].until + cap else 1
        duration = min(base * 2 ** (strikes - 1), cap)
        until = now + duration
        if last is not None and last[0] is state and not last[1].until_answered:
            # A timed ejection still running (an answer past a bound) is not
            # cut short by a held one that the next answer would lift.
            until = max(until, last[1].until)
        ejection = Ejection(code, reason, until, duration, strikes, until_answered)
        self._held[state.replica_id] = (state, ejection)
        self._balancer.keep_out(state, float("inf") if until_answered else until)
        self._on_eject(code)
        return ejection

    def held(self, state: EndpointState) -> Ejection | None:
        """The ejection `state` is held out by until it answers, or None."""
        last = self._held.get(state.replica_id)
        if last is None or last[0] is not state or not last[1].until_answered:
            return None
        return last[1]

    def answered(self, state: EndpointState) -> bool:
        """`state` answered: lift its held ejection if its back-off has run out; True when it is back.

        Lifted, the ejection is kept as a timed one that ended now, so a
        replica that is ejected again soon counts another strike.
        """
        ejection = self.held(state)
        if ejection is None:
            return False
        now = self._clock()
        if now < ejection.until:
            return False
        self._held[state.replica_id] = (state, replace(ejection, until=now, until_answered=False))
        self._balancer.readmit(state)
        return True

    def current(self) -> dict[str, Ejection]:
        """{replica id: its ejection} for endpoints listed now and still out; older records are dropped."""
        if not self._held:
            return {}
        now = self._clock()
        out: dict[str, Ejection] = {}
        for rid, (state, ejection) in list(self._held.items()):
            if self._balancer.state_of(rid) is not state:
                del self._held[rid]     # gone, or replaced by a new state under a new URL
            elif ejection.until_answered or now < ejection.until:
                out[rid] = ejection
            elif now >= ejection.until + self.cap:
                del self._held[rid]     # long enough back in service to start afresh
        return out
