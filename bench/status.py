"""What `GET /api/v1/status` and a `/metrics` scrape cost at fleet size, in process, split by stage.

    python3 -m bench.status [--nodes 5000] [--repeat 5] [--profile]

A real `Controller` (catalog directory, inventory, reconciler) is fed
`--nodes` simulated nodes of 8 GPUs through the inventory's own report path
(`tests/fleetsim.SimAgent.report()`, no HTTP), with bench/fleet.py's catalog:
4 one-GPU replicas per node, `big` x 1,000 and the rest over nodes/5 models.
Two passes place every replica and see it ready. Then, best and median of
`--repeat`:

  state      Controller.state(): the typed records
  to_dict    ControlStatus.to_dict()
  encode     json.dumps of that dict (what web.json_response does)
  body       Controller.status_json(): what the status route sends, as it does it
  after one  the body again after one replica changed state (a pass ran)
  metrics    ControlMetrics.render(): one Prometheus scrape

`--profile` prints cProfile's top functions of one whole status build and encode.
It measures this process only; bench/fleet.py measures serve over HTTP.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmgwctl.contracts import ReplicaState
from llmgwctl.control.controller import Controller
from llmgwctl.observability.metrics import ControlMetrics
from llmgwctl.router import Router
from tests.fleetsim import ENGINE_YAML, SimAgent, SimFleet, SimReplica

BIG = 1000


def model_yaml(name: str, replicas: int) -> str:
    return (f"  - name: {name}\n    source: sim/{name}\n    replicas: {replicas}\n    profiles:\n"
            f"      - name: p\n        engine: sim\n        gpus: 1\n")


def build(nodes: int, router: Router | None = None, prefix: str = "llmgw-status-",
          **options: Any) -> tuple[Controller, list[SimAgent]]:
    """The fleet every replica ready; with `router` (an in-process Router) wired as serve wires it;
    `options` for the Controller."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    big = min(BIG, 2 * nodes)
    models = max(100, nodes // 5) if nodes >= 500 else max(1, nodes // 5)
    per_model = max(1, (4 * nodes - big) // models)
    head = "apiVersion: llmgw/v1\nkind: Catalog\n"
    (directory / "engines.yaml").write_text(head + ENGINE_YAML)
    (directory / "base.yaml").write_text(head + "models:\n" + model_yaml("big", big)
                                         + "".join(model_yaml(f"m{i:04d}", per_model) for i in range(models)))
    c = Controller(str(directory), router=router, settle=0, **options)
    catalog = c.load()
    if router is not None:
        router.set_catalog(catalog)
    fleet = SimFleet("http://127.0.0.1:1", nodes)
    for agent in fleet.agents:
        c.inventory.report(agent.name, agent.report())
    c.reconciler.reconcile_once()            # places every replica
    for agent in fleet.agents:
        _, specs = c.desired.get(agent.name) or (0, ())
        for port, spec in enumerate(specs, 20001):
            agent.replicas[spec.id] = SimReplica(spec, port, ReplicaState.READY)
        c.inventory.report(agent.name, agent.report())
    c.reconciler.reconcile_once()            # sees them ready
    return c, fleet.agents


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    import logging
    logging.disable(logging.INFO)           # 20,000 "placed" events are not what is measured
    t = time.perf_counter()
    c, agents = build(a.nodes)
    print(f"fleet: {a.nodes} nodes, {len(c.reconciler.replicas)} replicas "
          f"({sum(r.state == ReplicaState.READY for r in c.reconciler.replicas.values())} ready), "
          f"built in {time.perf_counter() - t:.1f} s")
    metrics = ControlMetrics(c.state, process=False)
    body_fn = getattr(c, "status_json", None) or (lambda: json.dumps(c.status()).encode())
    state, doc = c.state(), c.status()
    rows = [("state", c.state), ("to_dict", state.to_dict), ("encode", lambda: json.dumps(doc)), ("body", body_fn)]
    agent = agents[0]

    def after_one() -> float:
        # One replica of the first node fails and comes back: a report, a pass, then the body.
        rep = next(iter(agent.replicas.values()))
        rep.state = ReplicaState.FAILED if rep.state == ReplicaState.READY else ReplicaState.READY
        c.inventory.report(agent.name, agent.report())
        c.reconciler.reconcile_once()
        t = time.perf_counter()
        body_fn()
        return time.perf_counter() - t

    rows.append(("metrics", metrics.render))
    size = len(body_fn())
    for name, fn in rows:
        best, med = timed(fn, a.repeat)
        print(f"{name:10s} best {best * 1e3:8.1f} ms   median {med * 1e3:8.1f} ms")
    changed = sorted(after_one() for _ in range(a.repeat))
    print(f"{'after one':10s} best {changed[0] * 1e3:8.1f} ms   median {statistics.median(changed) * 1e3:8.1f} ms")
    print(f"body       {size / 1e6:.1f} MB")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        json.dumps(c.state().to_dict())
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
