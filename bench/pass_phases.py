"""Where one reconcile pass's time goes at fleet size, phase by phase, in process.

    python3 -m bench.pass_phases [--nodes 5000] [--changed 50] [--passes 3]

bench/rollout.py's fleet (bench/status.py's catalog, `--nodes` nodes of 8
GPUs, every replica ready, the in-process router as serve wires it) fed
through the API's report path minus HTTP. Then `--passes` passes with
nothing changed, and `--passes` passes each after `--changed` random nodes'
replicas flipped between starting and ready (the slice of a rollout one
woken pass sees in serve). Each line: the whole pass, then the ms of each
phase in it, largest first (phases nest: `plan` holds `wanted`, `trim`,
`placement_input`, `place` and `model_states`; `publish` holds
`ready_endpoints` and the router's `set_endpoints`). Each phase is a method
of the reconciler's part that owns it (llmgwctl/reconciler/). Wall time of this process; run it on a quiet
machine and compare runs of two trees made back to back.
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import logging
import random
import time
from typing import Any

from llmgwctl.contracts import ReplicaState
from llmgwctl.control.serve import GC_THRESHOLDS
from llmgwctl.reconciler import core, planning
from llmgwctl.reconciler.adoption import Adoption
from llmgwctl.reconciler.placement_input import PlacementInput
from llmgwctl.reconciler.planning import Planner
from llmgwctl.reconciler.publishing import Publisher
from llmgwctl.reconciler.scaling import Scaling

from . import rollout

# (label, owner, attribute): every phase of a pass, by the part that does it.
PHASES = (("merge", Adoption, "merge"), ("lost_nodes", Adoption, "lost_nodes"), ("plan", core.Reconciler, "_plan"),
          ("drain", Planner, "drain"), ("publish", Publisher, "publish"), ("wanted", Scaling, "wanted"),
          ("trim", Adoption, "trim"), ("placement_input", PlacementInput, "build"),
          ("ready_endpoints", Publisher, "_ready_endpoints"), ("model_states", Publisher, "derive_model_states"),
          ("place", planning, "place"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--changed", type=int, default=50)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--no-freeze", action="store_true", help="leave the built fleet in the collected heap, as serve's is")
    a = p.parse_args()
    logging.disable(logging.INFO)
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)

    def timed(name: str, owner: object, attr: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        setattr(owner, attr, wrapper)

    for name, owner, attr in PHASES:
        timed(name, owner, attr)
    c, agents = rollout.build(a.nodes)
    r = c.reconciler
    for name in ("usage_snapshot", "inflight_seconds", "load_snapshot"):
        timed(name, r.usage, name)
    for sink in r.publisher.sinks:
        timed("set_endpoints", sink, "set_endpoints")
    for agent in agents:
        rollout.report(c, agent)
    r.reconcile_once()
    r.reconcile_once()
    if not a.no_freeze:
        gc.freeze()     # the built fleet out of the collector's way: the passes' own cost, not the heap's
    gc.set_threshold(*GC_THRESHOLDS)

    def one(label: str) -> None:
        spent.clear()
        t = time.perf_counter()
        r.reconcile_once()
        total = time.perf_counter() - t
        print(f"{label:18s} {total * 1e3:6.1f} ms  "
              + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])))

    print(f"fleet: {a.nodes} nodes, {len(r.replicas)} replicas, {len(c.live.current)} models")
    for _ in range(a.passes):
        one("steady")
    rng = random.Random(1)
    for _ in range(a.passes):
        for agent in rng.sample(agents, a.changed):
            for rep in agent.replicas.values():
                rep.state = ReplicaState.STARTING if rep.state == ReplicaState.READY else ReplicaState.READY
            rollout.report(c, agent)
        one(f"{a.changed} nodes changed")


if __name__ == "__main__":
    main()
