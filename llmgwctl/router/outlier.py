"""Outlier ejection on consecutive missed polls: a wedged engine leaves the routing within seconds.

An engine that is stopped (SIGSTOP, a GPU hang, a deadlocked API server)
still has its socket: the kernel accepts connections for it and nobody ever
answers, so every request sent there hangs until its client gives up, and the
agent, which may not even see it (a partition between router and engine is
invisible from the node), reports it ready. What the router does see is its
own polls of the engine's `/metrics` going unanswered. `Outliers` counts them
per endpoint: `after` misses in a row eject the endpoint until it answers
again (Envoy's outlier detection on consecutive failures, with active
re-probing while ejected: the poller keeps polling it). It comes back at the
first answer once its back-off has run out: `base` for the first ejection,
doubled for each one that follows within `cap` of the last, up to `cap`, so
an engine that keeps wedging serves less and less. `after` 0 ejects nothing
(`--eject-after 0`: the agents' health probes alone withdraw a replica), but
the misses are still counted: `silent` is how the router tells a replica
withdrawn for not answering from one drained while it answers.

It decides; `Ejector` holds the ejection and says why (status rows and the
`llmgw_router_endpoint_ejected` gauge, reason `no_answer`). It must not know
about HTTP: the poller tells it an endpoint missed or answered, and it tells
`on_wedged` each endpoint it ejects, so the requests already waiting there
move to another replica (inflight.py) rather than wait out their timeouts.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .balancer import Balancer, EndpointState
from .ejection import Ejection, Ejector

log = logging.getLogger("llmgw.router.outlier")

CODE = "no_answer"      # the metric label and the ejection's code

# Three misses in a row: one is noise (a poll that met a stop-the-world GC or
# a dropped packet), three at a one-second poll are three seconds of silence
# from an engine whose API server answers /metrics in milliseconds even while
# it generates -- and with the poll's own timeout that still takes a wedged
# replica out of routing within about four seconds, under the five the
# gateway promises.
EJECT_AFTER = 3
# Back in routing at the first answer once this much has passed since the
# ejection: long enough that an engine answering between two stalls does not
# take a burst of requests into the next one, short enough that one which
# recovered serves again before its peers notice the missing capacity.
# Doubled per ejection within CAP of the last: an engine that hangs every
# minute is kept out for most of it; the agent restarts one wedged for long.
BASE = 5.0
CAP = 120.0


class Outliers:
    """Consecutive missed polls per endpoint; `missed()` and `answered()` are the poller's to call."""

    def __init__(self, balancer: Balancer, ejector: Ejector, *, clock: Callable[[], float] = time.monotonic,
                 after: int = EJECT_AFTER, base: float = BASE, cap: float = CAP,
                 on_wedged: Callable[[EndpointState, str], object] = lambda state, reason: None):
        self._balancer, self._ejector, self._clock = balancer, ejector, clock
        self.after, self.base, self.cap = after, base, cap     # misses that eject; the back-off
        # Told each endpoint this ejects, and why: the requests in flight to it move (inflight.py).
        self._on_wedged = on_wedged
        # replica id -> (its state, misses in a row, when the first of them was)
        self._misses: dict[str, tuple[EndpointState, int, float]] = {}

    def missed(self, state: EndpointState, why: str, took: float = 0.0) -> Ejection | None:
        """`state`'s engine did not answer a poll that ended now after `took` seconds (`why`: timed out
        after 1 s, connection refused...); the ejection when this miss ejects it, else None."""
        now = self._clock()
        seen = self._misses.get(state.replica_id)
        # The silence began when the first missed poll was sent.
        count, first = (seen[1] + 1, seen[2]) if seen is not None and seen[0] is state else (1, now - took)
        self._misses[state.replica_id] = (state, count, first)
        if self._ejector.held(state) is not None:
            # Still silent: stay out, even if a failed request's short
            # ejection (Balancer.eject) has since moved the time it ends.
            self._balancer.keep_out(state, float("inf"))
            return None
        if not self.after or count < self.after:
            return None     # 0: never ejected by the router, but still counted as silent
        reason = f"no answer to {count} health probes in {max(1.0, now - first):.0f} s ({why})"
        ejection = self._ejector.eject(state, CODE, reason, base=self.base, cap=self.cap, until_answered=True)
        log.warning("endpoint %s: %s; out of routing until it answers", state.replica_id, reason,
                    extra={"event": "endpoint-ejected", "endpoint": state.replica_id, "reason": CODE})
        self._on_wedged(state, reason)
        return ejection

    def answered(self, state: EndpointState) -> None:
        """`state`'s engine answered a poll: the misses start again from none, and a held ejection whose
        back-off has run out ends."""
        self._misses.pop(state.replica_id, None)
        if self._ejector.answered(state):
            log.info("endpoint %s answers again; back in routing", state.replica_id,
                     extra={"event": "endpoint-readmitted", "endpoint": state.replica_id, "reason": CODE})

    def silent(self) -> dict[str, EndpointState]:
        """{replica id: its state} for the endpoints whose last poll went unanswered."""
        return {rid: seen[0] for rid, seen in self._misses.items()} if self._misses else {}

    def retain(self, listed: set[str]) -> None:
        """Forget the endpoints no longer listed."""
        for rid in [r for r in self._misses if r not in listed]:
            del self._misses[rid]
