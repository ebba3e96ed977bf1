"""What a pass keeps from the last one must never be stale (issue 19).

A pass keeps placement's input (a Running per record, a NodeView per node),
each node's merge and each Endpoint, and rebuilds only what changed. These
tests change one input at a time -- a node's report, a record's state, a
catalog swap -- on a node whose kept state the pass before had used, and
check that the next pass sees the change, and that what placement is handed
equals a build from scratch (what `PlacementInput.build` keeps must equal).
"""
from __future__ import annotations

import pytest

from llmgwctl.contracts import ReplicaState
from llmgwctl.placement import NodeView, Running
from llmgwctl.reconciler import planning

from .test_reconciler import World, catalog, converge, model, run_report


def from_scratch(rec):
    """Placement's input as the reconciler built it before it kept any (issue 19's before)."""
    cat = rec.live.current
    expected = rec.placement_input.expected_hashes(cat)
    running = [Running(replica_id=r.spec.id, model=r.spec.model, profile=r.spec.profile, node=r.node,
                       gpu_indices=r.spec.gpu_indices,
                       current=r.spec_hash == expected.get((r.spec.model, r.spec.profile)),
                       ready=r.state == ReplicaState.READY, failed=r.state == ReplicaState.FAILED,
                       leaving=r.state in (ReplicaState.DRAINING, ReplicaState.STOPPING),
                       memory_mib=r.spec.gpu_memory_mib) for r in rec.replicas.values()]
    views = []
    for node in rec.inventory.nodes():
        if not node.reachable:
            running.extend(rec.placement_input.given_up_on(node, expected))
        custom = frozenset(n for n, e in cat.engines.items() if not e.builtin and n not in node.engines)
        views.append(NodeView(name=node.name, pools=node.pools, gpus=tuple(g.index for g in node.gpus),
                              memory={g.index: (g.memory_mib, g.free_mib) for g in node.gpus},
                              engines=node.available_engines | custom,
                              schedulable=node.reachable and node.name not in rec.placement_input.cordoned,
                              unavailable={n: why for n, (ok, why) in node.engines.items() if not ok}))
    return running, views


def same_input(rec):
    running, views = rec.placement_input.build(rec.live.current)
    want_running, want_views = from_scratch(rec)
    assert running == want_running
    # NodeView leaves memory and unavailable out of its equality; placement reads both.
    assert [(v, dict(v.memory), dict(v.unavailable)) for v in views] == \
        [(v, dict(v.memory), dict(v.unavailable)) for v in want_views]


@pytest.fixture
def handed(monkeypatch):
    """What each pass handed placement: the real place(), watched."""
    calls = []
    real = planning.place

    def place(catalog, nodes, running, wanted, **kw):
        calls.append((list(nodes), list(running)))
        return real(catalog, nodes, running, wanted, **kw)
    monkeypatch.setattr(planning, "place", place)
    return calls


def test_an_unchanged_pass_keeps_placements_input_and_does_not_place_again(handed):
    w = World(catalog(model("a", replicas=2)), settle=0)
    for n in ("n1", "n2"):
        w.report(n)
    converge(w, ("n1", "n2"))
    running1, views1 = w.rec.placement_input.build(w.live.current)
    calls = len(handed)
    w.quiet_pass()
    w.quiet_pass()
    assert len(handed) == calls, "the same input as the last call: its plan is taken again"
    running2, views2 = w.rec.placement_input.build(w.live.current)
    assert len(running2) == 2 and all(a is b for a, b in zip(running1, running2))
    assert all(a is b for a, b in zip(views1, views2))
    same_input(w.rec)
    # A node's GPU memory is outside NodeView's equality but placement reads it: placed again.
    w.inventory.report("n2", {"node": "n2", "pools": ["gpu"], "engines": {"fake": {"available": True, "reason": ""}},
                              "gpus": [{"index": i, "uuid": f"n2-{i}", "name": "A100", "memory_mib": 40960,
                                        "memory_free_mib": 1000} for i in range(2)],
                              "replicas": list(w.running["n2"].values())})
    w.quiet_pass()
    assert len(handed) == calls + 1 and dict(handed[-1][0][1].memory) == {0: (40960, 1000), 1: (40960, 1000)}
    same_input(w.rec)
    # A catalog swap, and a wanted count that changes, place again too.
    w.live.swap(catalog(model("a", replicas=3)))
    w.quiet_pass()
    assert len(handed) == calls + 2 and len(w.rec.replicas) == 3


def test_a_record_changing_state_is_seen_by_the_next_placement(handed):
    w = World(catalog(model("a", replicas=2)), settle=0)
    for n in ("n1", "n2"):
        w.report(n)
    converge(w, ("n1", "n2"))
    w.quiet_pass()
    # Scaled down by a catalog swap: placement stops one, which drains (leaving) ...
    w.live.swap(catalog(model("a", replicas=1)))
    w.quiet_pass()
    same_input(w.rec)
    leaving = [r for r in w.rec.replicas.values() if r.state in (ReplicaState.DRAINING, ReplicaState.STOPPING)]
    assert len(leaving) == 1
    w.quiet_pass()
    assert [r.replica_id for r in handed[-1][1] if r.leaving] == [leaving[0].spec.id]
    # ... and a state set by hand on a node whose report did not change: the merge
    # is not skipped (the report says ready again), nor is placement's view of it.
    ready = [r for r in w.rec.replicas.values() if r.state == ReplicaState.READY]
    assert len(ready) == 1
    ready[0].state = ReplicaState.FAILED
    w.rec.adoption.merge(w.live.current, w.clock.now, w.rec.settled)
    assert ready[0].state == ReplicaState.READY, "the report says ready"
    ready[0].state = ReplicaState.FAILED
    assert [r.replica_id for r in w.rec.placement_input.build(w.live.current)[0] if r.failed] == [ready[0].spec.id]
    same_input(w.rec)


def test_a_node_report_changing_is_seen_by_the_next_pass_after_passes_that_skipped_it():
    w = World(catalog(model("a"), model("b", pool="other")), settle=0)
    w.report("n1")
    w.report("n2")
    converge(w, ("n1", "n2"))
    assert [r.spec.model for r in w.rec.replicas.values()] == ["a"], "b has no node of its pool"
    for _ in range(3):
        w.quiet_pass()          # n2's report and records unchanged: its merge and view are kept
    w.report("n2", pools=("gpu", "other"))
    w.quiet_pass()
    same_input(w.rec)
    assert sorted((r.spec.model, r.node) for r in w.rec.replicas.values()) == [("a", "n1"), ("b", "n2")]
    spec = next(r.spec for r in w.rec.replicas.values() if r.spec.model == "b")
    # Starting, then ready, each seen by the pass after the report, however many quiet passes came between.
    w.running["n2"] = {spec.id: run_report(spec, "starting", 20001)}
    w.report("n2", pools=("gpu", "other"))
    w.quiet_pass()
    w.quiet_pass()
    assert w.rec.replicas[spec.id].state == ReplicaState.STARTING
    w.running["n2"] = {spec.id: run_report(spec, "ready", 20001)}
    w.report("n2", pools=("gpu", "other"))
    w.quiet_pass()
    assert w.rec.replicas[spec.id].state == ReplicaState.READY
    assert spec.id in {e.replica_id for e in w.rec.endpoints}
    same_input(w.rec)


def test_a_record_stopped_before_its_agent_listed_it_is_gone_though_the_report_never_changed():
    # The merge of n1 is kept while its report and its records are unchanged; here the
    # report stays the same object throughout, and only the record's state moves.
    w = World(catalog(model("a"), model("b")), settle=0)
    w.report("n1", gpus=2)
    converge(w, ("n1",))
    w.report("n1", gpus=2)
    w.live.swap(catalog(model("a"), model("b"), model("c", gpus=0)))
    w.quiet_pass()
    c = next(r for r in w.rec.replicas.values() if r.spec.model == "c")
    assert c.state == ReplicaState.PENDING and c.spec.id not in w.inventory.get("n1").replicas
    w.live.swap(catalog(model("a"), model("b")))     # c leaves before n1's agent ever ran it
    w.quiet_pass()
    w.quiet_pass()
    assert c.spec.id not in w.rec.replicas, "stopping and not reported: gone, as a full merge says"
    assert {r.spec.model for r in w.rec.replicas.values()} == {"a", "b"}


def test_a_swap_that_keeps_a_profile_keeps_its_endpoints_and_one_that_changes_it_rebuilds_them():
    w = World(catalog(model("a", replicas=2, gpus=0), model("b", gpus=0)), settle=0)
    w.report("n1")
    converge(w)
    before = {e.replica_id: e for e in w.rec.endpoints}
    pushes = len(w.sink.pushes)
    w.live.swap(catalog(model("a", replicas=2, gpus=0), model("b", gpus=0), model("c", pool="none")))
    w.quiet_pass()
    assert all(before[e.replica_id] is e for e in w.rec.endpoints), "priority and weight unchanged: kept"
    assert len(w.sink.pushes) == pushes
    w.live.swap(catalog(model("a", replicas=2, gpus=0).replace("gpus: 0", "gpus: 0, weight: 4"), model("b", gpus=0)))
    w.quiet_pass()
    assert {e.model: e.weight for e in w.rec.endpoints} == {"a": 4.0, "b": 1.0}
    assert len(w.sink.pushes) == pushes + 1


def test_lost_and_back_with_the_same_report_is_merged_again():
    w = World(catalog(model("a", replicas=2)), settle=0)
    w.report("n1")
    w.report("n2")
    converge(w, ("n1", "n2"))
    lost = next(r for r in w.rec.replicas.values() if r.node == "n2")
    w.alive.discard("n2")
    w.step(16)                       # past the node timeout: lost, out of the router
    assert lost.state == ReplicaState.LOST and lost.spec.id not in {e.replica_id for e in w.rec.endpoints}
    same_input(w.rec)
    w.report("n2")                   # the very report it sent before it went silent
    w.step()
    assert lost.state == ReplicaState.READY and lost.spec.id in {e.replica_id for e in w.rec.endpoints}
    same_input(w.rec)
