"""A profile change of 1,000 replicas at fleet size, in process, step by step: where a rollout's time goes.

    python3 -m bench.rollout [--nodes 5000] [--profile STEP] [--top 25]

A real `Controller` with the in-process `Router` as serve wires them (its
endpoint sink and usage source) and a `ControlAPI` are fed `--nodes`
simulated nodes of 8 GPUs through the API's own report path minus HTTP (the
bytes an agent sends, parsed, schema- and URL-checked, into the inventory),
with bench/status.py's catalog: `big` x 1,000 and the rest over nodes/5
models, every replica ready.
Then `big`'s args change, and the rollout is walked as serve walks it, each
step timed (seconds of this process, GC included, with serve's thresholds;
a full collection in a step is named):

  load       the watcher reads and validates the directory and swaps it in
  place      the pass that places the 1,000 replacements
  desired    the long-poll answers of the nodes whose lists changed, encoded as the API does
  starting   those nodes' reports (replacements starting), then a pass
  ready      the same nodes' reports (replacements ready), then the pass that publishes them
  watch      the routers' delta answer for that pass, encoded once as the API does
  stopped    the old replicas gone from the nodes' reports, then a pass

`--profile STEP` prints cProfile's top functions of that step. No HTTP, no
loop: what it leaves out is aiohttp's per-request cost and the waits between
passes (reconciler.WOKEN_SHARE); bench/fleet.py measures serve with them.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import pstats
import time
from collections.abc import Callable
from pathlib import Path

from llmgwctl.contracts import ReplicaState
from llmgwctl.control import schemas
from llmgwctl.control.api import ControlAPI, replica_url_problem
from llmgwctl.control.controller import Controller
from llmgwctl.control.serve import GC_THRESHOLDS
from llmgwctl.router import Router, RouterConfig
from tests.fleetsim import SimAgent, SimReplica

from . import status


def build(nodes: int) -> tuple[Controller, list[SimAgent]]:
    """bench/status.py's fleet, with the in-process router as serve wires it (its endpoint sink and usage source)."""
    return status.build(nodes, router=Router(waker=None, config=RouterConfig()), prefix="llmgw-rollout-")


def report(c: Controller, agent: SimAgent) -> None:
    """One agent's report as the API takes it: the bytes, parsed, checked, then into the inventory."""
    raw = json.dumps(agent.report().to_dict()).encode()
    body = json.loads(raw)
    assert not schemas.problems("agent-report", body)
    assert replica_url_problem(body, "127.0.0.1") is None
    c.agent_reported(agent.name, body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--profile", action="append", default=[], help="a step to profile (repeatable)")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    logging.disable(logging.INFO)           # thousands of "placed" events are not what is measured
    gc.set_threshold(*GC_THRESHOLDS)
    t = time.perf_counter()
    c, agents = build(a.nodes)
    r = c.reconciler
    api = ControlAPI(c)
    by_name = {x.name: x for x in agents}
    for agent in agents:                    # once through the API's path, so its memories are warm
        report(c, agent)
    r.reconcile_once()
    r.reconcile_once()
    old = {rid for rid, rec in r.replicas.items() if rec.spec.model == "big"}
    print(f"fleet: {a.nodes} nodes, {len(r.replicas)} replicas, {len(old)} of big; built in "
          f"{time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    r.reconcile_once()
    print(f"{'steady':10s} {(time.perf_counter() - t) * 1e3:8.1f} ms  (a pass with nothing changed)")
    held = {x.name: (c.desired.get(x.name) or (0, ()))[0] for x in agents}
    watch_version = c.watch.version
    api.routers._watchlog.answered(watch_version, r.endpoints, c.live.current.version)

    full: list[float] = []           # seconds of each full collection since the last step
    began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                full.append(time.perf_counter() - began[0])

    gc.callbacks.append(on_gc)

    def step(name: str, fn: Callable[[], str]) -> None:
        prof = cProfile.Profile() if name in a.profile else None
        full.clear()
        t = time.perf_counter()
        if prof:
            prof.enable()
        out = fn()
        if prof:
            prof.disable()
        took = time.perf_counter() - t
        collections = f"; {len(full)} full GC of {sum(full) * 1e3:.0f} ms in it" if full else ""
        print(f"{name:10s} {took * 1e3:8.1f} ms  {out or ''}{collections}")
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(a.top)
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)

    changed_nodes: list[str] = []

    def load() -> str:
        directory = Path(c.watcher.directory)
        text = (directory / "base.yaml").read_text()
        was = status.model_yaml("big", len(old))
        assert was in text
        (directory / "base.yaml").write_text(text.replace(was, was + "        args: [--changed]\n"))
        outcome = c.watcher.reload()
        assert outcome.rejection is None, outcome.rejection
        return f"catalog {c.live.current.version}"

    def place() -> str:
        r.reconcile_once()
        new = [rec for rec in r.replicas.values() if rec.spec.model == "big" and rec.spec.id not in old]
        return f"{len(new)} replacements placed"

    def desired() -> str:
        n = 0
        for name, version in held.items():
            entry = c.desired.get(name)
            if entry is None or entry[0] == version:
                continue
            version, specs = entry
            body = json.dumps({"version": version, "replicas": [s.to_dict() for s in specs]}).encode()
            n += len(body)
            changed_nodes.append(name)
            held[name] = version
            agent = by_name[name]
            for port, spec in enumerate(specs, 30001):
                if spec.id not in agent.replicas:
                    agent.replicas[spec.id] = SimReplica(spec, port, ReplicaState.STARTING)
        return f"{len(changed_nodes)} nodes' answers, {n / 1e6:.1f} MB"

    def reports_then_pass(state: ReplicaState | None) -> Callable[[], str]:
        def run() -> str:
            # The old replicas' nodes, when they go: some are not among the replacements' nodes.
            names = changed_nodes if state is not None else [x.name for x in agents if old & x.replicas.keys()]
            for name in names:
                agent = by_name[name]
                for rid in list(agent.replicas):
                    if state is None and rid in old:
                        del agent.replicas[rid]
                    elif state is not None and rid not in old:
                        agent.replicas[rid].state = state
                report(c, agent)
            t = time.perf_counter()
            r.reconcile_once()
            return f"{len(names)} reports, then a pass of {(time.perf_counter() - t) * 1e3:.1f} ms"
        return run

    def watch() -> str:
        api.routers._watchlog.answered(c.watch.version, r.endpoints, c.live.current.version)
        body = api.routers._encoded_delta(watch_version)
        assert body is not None
        delta = json.loads(body)["delta"]
        return f"{len(delta['endpoints'])} endpoints, {len(delta['removed'])} removed, {len(body) / 1e6:.2f} MB"

    step("load", load)
    step("place", place)
    step("desired", desired)
    step("starting", reports_then_pass(ReplicaState.STARTING))
    step("ready", reports_then_pass(ReplicaState.READY))
    ready_new = sum(1 for e in r.endpoints if e.model == "big" and e.replica_id not in old)
    ready_old = sum(1 for e in r.endpoints if e.replica_id in old)
    print(f"{'':10s} endpoints: {ready_new} new of big, {ready_old} old")
    step("watch", watch)
    step("stopped", reports_then_pass(None))
    left = sum(1 for rid in old if rid in r.replicas)
    print(f"{'':10s} old records left: {left}")


if __name__ == "__main__":
    main()
