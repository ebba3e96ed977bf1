"""A model's endpoints as a policy's table row describes them, and the pick the router would make.

A row names each endpoint with its load (requests in flight), weight and
whether its engine is queueing (no room: not a candidate); `Scene.pick`
runs the balancer's pick with the policy's chooser, as the request path does.
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgwctl.contracts import Endpoint, LoadReading
from llmgwctl.router.balancer import Balancer, EndpointState
from llmgwctl.router.policies import Policies

from ...support import FakeClock

MODEL = "m"
# The tests state the cost model's exchange rate rather than inherit the
# default, so their arithmetic stays true when the default is retuned.
PER_REQUEST = 256.0


@dataclass(frozen=True)
class Ep:
    """One endpoint of a table row."""

    rid: str
    load: int = 0            # requests this router has in flight on it
    weight: float = 1.0
    queued: bool = False     # its engine reports requests waiting: no room, so not a candidate


class Scene:
    def __init__(self, *eps: Ep, seed: int = 7):
        self.clock = FakeClock()
        self.balancer = Balancer(clock=self.clock, stale_after=3.0, rng=random.Random(seed))
        self.balancer.set_endpoints([Endpoint(replica_id=e.rid, model=MODEL, profile="p", engine="fake",
                                              url=f"http://127.0.0.1:{2000 + i}", weight=e.weight)
                                     for i, e in enumerate(eps)])
        self.policies = Policies(self.balancer, tokens_per_request=PER_REQUEST)
        self.load(*eps)

    def state(self, rid: str) -> EndpointState:
        st = self.balancer.state_of(rid)
        assert st is not None, rid
        return st

    def load(self, *eps: Ep) -> None:
        """Set each endpoint's load as the row says."""
        for e in eps:
            st = self.state(e.rid)
            st.inflight = e.load
            if e.queued:
                self.balancer.record(st, LoadReading(running=e.load, waiting=1), sent_inflight=e.load)

    def pick(self, policy: str, doc: Mapping[str, Any], headers: Mapping[str, str] | None = None,
             only: str | None = None) -> str:
        """The endpoint the router sends `doc` to; `only`: as if the others were excluded (a retry's pick)."""
        exclude = tuple(st for st in self.balancer.states() if only is not None and st.replica_id != only)
        st = self.balancer.pick(MODEL, exclude, self.policies.chooser(policy, MODEL, doc, headers))
        assert st is not None
        return st.replica_id
