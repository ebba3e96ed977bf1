"""What keeps the control plane's cost in proportion to change, not to the fleet (issue 19).

- a heartbeat that repeats the node's last report wakes no pass (the controller)
  and moves no revision (the inventory);
- a pass that changes nothing hands no node list to the desired store and
  pushes no endpoint list, and what it does publish is what a from-scratch
  build over every record gives;
- the loop's idle spacing still runs a pass at once for what cannot wait.
"""
from __future__ import annotations

import asyncio

from llmgwctl.contracts import Endpoint, ReplicaState
from llmgwctl.control.controller import Controller
from llmgwctl.reconciler import _due

from .test_reconciler import HEADER, World, catalog, converge, model, run_report


def report_body(node, replicas=()):
    return {"node": node, "instance_id": f"i-{node}", "pools": ["gpu"],
            "engines": {"fake": {"available": True, "reason": ""}},
            "gpus": [{"index": i, "uuid": f"{node}-{i}", "name": "A100"} for i in range(2)],
            "replicas": list(replicas)}


def test_a_heartbeat_repeating_the_last_report_does_not_wake_the_reconciler(tmp_path):
    (tmp_path / "c.yaml").write_text(HEADER + model("a"))

    async def main():
        c = Controller(str(tmp_path), settle=0)
        c.load()
        c.agent_reported("n1", report_body("n1"))
        assert c.wake_event.is_set(), "a node's first report is news"
        revision = c.inventory.get("n1").revision
        c.wake_event.clear()
        for _ in range(3):
            c.agent_reported("n1", report_body("n1"))
        assert not c.wake_event.is_set()
        node = c.inventory.get("n1")
        assert node.revision == revision and node.reports == 4, "heard (last_seen moves), but nothing changed"
        c.reconciler.reconcile_once()
        spec = c.desired.get("n1")[1][0]
        c.wake_event.clear()
        c.agent_reported("n1", report_body("n1", [run_report(spec, "starting", 20001)]))
        assert c.wake_event.is_set() and c.inventory.get("n1").revision == revision + 1
        c.wake_event.clear()
        c.agent_reported("n1", report_body("n1", [run_report(spec, "ready", 20001)]))
        assert c.wake_event.is_set(), "a replica's state changing is news"

    asyncio.run(main())


def test_a_node_coming_back_with_the_same_report_is_news():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    node = w.inventory.get("n1")
    revision = node.revision
    w.clock.advance(20)
    w.inventory.check()
    assert not node.reachable
    w.report("n1")
    assert node.reachable and node.revision == revision + 1


def from_scratch(rec):
    """What _publish used to compute every pass: every node's list and every endpoint, rebuilt."""
    catalog = rec.live.current
    per_node = {}
    for r in rec.replicas.values():
        if r.state != ReplicaState.STOPPING:
            per_node.setdefault(r.node, set()).add(r.spec.id)
    endpoints = []
    for r in sorted(rec.replicas.values(), key=lambda r: r.spec.id):
        node = rec.inventory.get(r.node)
        if r.state != ReplicaState.READY or not r.url or node is None or not node.reachable:
            continue
        profile = next(p for p in catalog.resolve(r.spec.model).profiles if p.name == r.spec.profile)
        endpoints.append(Endpoint(replica_id=r.spec.id, model=r.spec.model, profile=r.spec.profile,
                                  engine=r.spec.engine, url=r.url, priority=profile.priority, weight=profile.weight,
                                  metrics_path=r.spec.metrics))
    return per_node, tuple(endpoints)


def published(w):
    return {n: {s.id for s in w.desired.get(n)[1]} for n in w.alive if w.desired.get(n)}, w.rec.endpoints


def test_a_pass_that_changes_nothing_publishes_nothing_and_what_is_published_matches_a_full_rebuild():
    w = World(catalog(model("a", replicas=2), model("b", replicas=3, gpus=0)), settle=0)
    nodes = ("n1", "n2", "n3")
    for n in nodes:
        w.report(n)
    converge(w, nodes)
    per_node, endpoints = from_scratch(w.rec)
    assert len(endpoints) == 5 and published(w) == ({n: per_node.get(n, set()) for n in nodes}, endpoints)
    versions = {n: w.desired.get(n)[0] for n in nodes}
    pushes, endpoints_version = len(w.sink.pushes), w.rec.endpoints_version
    for _ in range(3):
        w.step()                                   # heartbeats, nothing changed
    assert {n: w.desired.get(n)[0] for n in nodes} == versions
    assert len(w.sink.pushes) == pushes and w.rec.endpoints_version == endpoints_version

    # A catalog swap changing a weight rebuilds the endpoints (weights come from the profile) ...
    w.live.swap(catalog(model("a", replicas=2), model("b", replicas=3, gpus=0).replace("gpus: 0", "gpus: 0, weight: 3")))
    w.step()
    assert {e.weight for e in w.rec.endpoints if e.model == "b"} == {3.0}
    assert published(w)[1] == from_scratch(w.rec)[1]
    # ... and a node lost takes its endpoints out, the same as a rebuild says.
    w.alive.discard("n1")
    for _ in range(17):
        w.step()
    for n in nodes[1:]:
        w.agent_follows(n)
    w.step()
    per_node, endpoints = from_scratch(w.rec)
    assert all(e.url for e in endpoints) and w.rec.endpoints == endpoints
    assert {n: {s.id for s in w.desired.get(n)[1]} for n in nodes[1:]} == {n: per_node.get(n, set()) for n in nodes[1:]}


def test_a_changed_list_is_handed_to_its_node_only():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    w.report("n2", pools=("other",))
    converge(w, ("n1",))
    w.report("n2", pools=("other",))        # World's heartbeats report the default pool
    before = {n: w.desired.get(n)[0] for n in ("n1", "n2")}
    w.live.swap(catalog(model("a"), model("b", pool="other")))
    w.rec.reconcile_once()
    assert w.desired.get("n1")[0] == before["n1"], "n1's list did not change: its agent is not woken"
    assert w.desired.get("n2")[0] != before["n2"] and [s.model for s in w.desired.get("n2")[1]] == ["b"]


def test_the_idle_loop_still_runs_a_pass_for_what_cannot_wait():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    converge(w)
    assert not _due(w.rec), "settled, every node heard, nothing draining: the tick may wait"
    w.clock.advance(16)
    assert _due(w.rec), "a node past its report timeout must leave the router promptly"
    w.report("n1")
    assert not _due(w.rec)
    rec = next(iter(w.rec.replicas.values()))
    rec.state = ReplicaState.DRAINING
    assert _due(w.rec), "a draining replica stops as soon as its requests are done"


def test_an_urgent_wake_does_not_wait_out_the_spacing_of_woken_passes():
    # A woken pass waits took / woken_share after the last one began; made endless here,
    # so only the urgent event (a catalog swap, a waiting request) can bring the next pass.
    from llmgwctl.reconciler import run

    from ..support import until

    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    passes = []
    w.rec.on_pass = passes.append

    async def main():
        wake, urgent, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run(w.rec, wake, stop, tick=3600, urgent=urgent, woken_share=1e-12))
        try:
            await until(lambda: len(passes) == 1, "the first pass")
            urgent.set()
            wake.set()
            await until(lambda: len(passes) == 2, "a pass at once for an urgent wake")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_routers_are_told_a_replica_left_before_its_agent_is_told_to_stop_it():
    w = World(catalog(model("a"), model("b")), settle=0)
    w.report("n1")
    converge(w)
    b = next(r for r in w.rec.replicas.values() if r.spec.model == "b")
    seen = []

    class Watching:
        def set_endpoints(self, endpoints):
            # What the node's agent is told at the moment the routers are: still b.
            seen.append(({e.replica_id for e in endpoints}, {s.id for s in w.desired.get("n1")[1]}))

        def change_endpoints(self, endpoints, changed):
            self.set_endpoints(endpoints)

        def set_model_states(self, states):
            pass

        def set_catalog(self, catalog):
            pass
    w.rec.add_sink(Watching())
    seen.clear()
    w.live.swap(catalog(model("a")))
    w.quiet_pass()                       # b drains, nothing in flight: stopping in the same pass
    assert b.state == ReplicaState.STOPPING and b.spec.id not in {s.id for s in w.desired.get("n1")[1]}
    assert len(seen) == 1 and b.spec.id not in seen[0][0] and b.spec.id in seen[0][1]
