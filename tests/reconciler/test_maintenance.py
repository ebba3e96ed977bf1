"""Cordon, drain and uncordon, one pass at a time (`Reconciler.reconcile_once`) with a fake clock.

The agents' side is played by the test (`World` of test_reconciler); the
end-to-end tests in tests/e2e/test_maintenance.py run the same with real
agents and the fake engine.
"""
from llmgwctl.contracts import ReplicaState, Scheduling

from .test_reconciler import World, catalog, converge, model


def nodes_of(w, name):
    return sorted((r.node, r.state) for r in w.rec.replicas.values() if r.spec.model == name)


def started(cat, node="n1"):
    """A settled World whose `node` runs what `cat` wants."""
    w = World(cat, settle=0)
    w.report(node)
    converge(w, nodes=(node,))
    return w


def follow(w, rounds=3, nodes=("n1", "n2")):
    for _ in range(rounds):
        w.step()
        for node in nodes:
            w.agent_follows(node)


def test_a_cordoned_node_gets_nothing_new_and_keeps_what_it_runs():
    w = started(catalog(model("a", replicas=1)))
    assert nodes_of(w, "a") == [("n1", "ready")]
    w.report("n2")
    assert w.rec.cordon("n2") and not w.rec.cordon("n2"), "cordon is idempotent"
    w.live.swap(catalog(model("a", replicas=3)))
    follow(w)
    # n1 has 2 GPUs: two fit there, the third has nowhere to go but the cordoned n2.
    assert nodes_of(w, "a") == [("n1", "ready"), ("n1", "ready")]
    assert "a" in w.rec.unplaceable
    assert w.rec.maintenance.state("n2") == Scheduling.CORDONED
    assert ("node-cordoned") in [e.kind for e in w.rec.events]
    w.rec.uncordon("n2")
    follow(w)
    assert nodes_of(w, "a") == [("n1", "ready"), ("n1", "ready"), ("n2", "ready")]
    assert w.rec.maintenance.state("n2") == Scheduling.SCHEDULABLE


def test_drain_surges_a_replacement_and_takes_the_old_one_out_only_once_it_is_ready():
    w = started(catalog(model("a", replicas=1)))
    w.report("n2")
    w.step()
    assert nodes_of(w, "a") == [("n1", "ready")]
    assert w.rec.drain("n1")
    w.step()
    # The replacement is placed on n2; n1's replica still serves (it is in the router).
    assert nodes_of(w, "a") == [("n1", "ready"), ("n2", "pending")]
    assert [w.rec.replicas[e.replica_id].node for e in w.sink.pushes[-1]] == ["n1"]
    assert w.rec.maintenance.state("n1") == Scheduling.DRAINING
    w.agent_follows("n2", state="starting")
    w.step()
    assert nodes_of(w, "a") == [("n1", "ready"), ("n2", "starting")], "not out before its replacement is ready"
    old = next(r for r in w.rec.replicas.values() if r.node == "n1")
    w.usage.snapshot = {old.spec.id: (w.clock.now, 1)}       # a request in flight on it
    for rep in w.running["n2"].values():
        rep["state"] = "ready"      # its health check passed
    w.report("n2")
    w.step()
    assert nodes_of(w, "a") == [("n1", "draining"), ("n2", "ready")]
    assert [w.rec.replicas[e.replica_id].node for e in w.sink.pushes[-1]] == ["n2"], \
        "the drained replica left the router"
    assert old.drain_reason == "node n1 is draining"
    old_id = old.spec.id
    w.step()
    assert old.state == ReplicaState.DRAINING and old_id in {s.id for s in w.desired.get("n1")[1]}
    w.usage.snapshot = {}
    w.step()
    assert old.state == ReplicaState.STOPPING
    w.agent_follows("n1")
    w.step()
    assert nodes_of(w, "a") == [("n2", "ready")]
    assert w.rec.maintenance.state("n1") == Scheduling.DRAINED
    kinds = [e.kind for e in w.rec.events]
    assert "node-draining" in kinds and "node-drained" in kinds
    # Drained stays cordoned: nothing comes back to n1 while it is held.
    w.live.swap(catalog(model("a", replicas=3)))
    follow(w)
    assert [n for n, _ in nodes_of(w, "a")] == ["n2", "n2"]
    w.rec.uncordon("n1")
    follow(w)
    assert [n for n, _ in nodes_of(w, "a")] == ["n1", "n2", "n2"]
    assert w.rec.maintenance.state("n1") == Scheduling.SCHEDULABLE


def test_drain_keeps_what_fits_and_drains_the_rest_when_there_is_no_room_elsewhere():
    w = World(catalog(model("a", replicas=3)), settle=0)
    w.report("n1")
    w.report("n2")
    converge(w, nodes=("n1", "n2"))
    on_n1 = sum(n == "n1" for n, _ in nodes_of(w, "a"))
    assert on_n1 and len(nodes_of(w, "a")) == 3
    w.rec.drain("n1")
    w.step()
    # n2's two GPUs take one more replica at most: that one is placed, the rest fit nowhere.
    assert sorted(s for n, s in nodes_of(w, "a") if n == "n1") == ["ready"] * on_n1
    w.agent_follows("n2")
    w.step()
    # Nothing more is coming, so n1 is drained anyway, as asked; n2 serves with all it holds.
    assert sorted(s for n, s in nodes_of(w, "a") if n == "n1") == ["stopping"] * on_n1
    assert [s for n, s in nodes_of(w, "a") if n == "n2"] == ["ready", "ready"]


def test_drain_of_a_node_whose_models_fit_nowhere_else_does_not_wait():
    w = started(catalog(model("a", replicas=1)))
    w.rec.drain("n1")
    w.step()
    assert nodes_of(w, "a") == [("n1", "stopping")], "nothing in flight: stopped in the same pass"


def test_a_replacement_that_never_comes_ready_holds_the_drain_only_for_the_surge_wait():
    w = started(catalog(model("a", replicas=1)))
    w.rec.maintenance.surge_wait = 100
    w.report("n2")
    w.step()
    w.rec.drain("n1")
    w.step()
    w.agent_follows("n2", state="starting")
    w.step(50)
    assert nodes_of(w, "a") == [("n1", "ready"), ("n2", "starting")]
    assert w.rec.maintenance.waiting()
    w.step(60)
    assert nodes_of(w, "a") == [("n1", "stopping"), ("n2", "starting")]


def test_uncordon_during_a_drain_keeps_replicas_not_yet_taken_out():
    w = started(catalog(model("a", replicas=1)))
    w.report("n2")
    w.step()
    w.rec.drain("n1")
    w.step()
    assert nodes_of(w, "a") == [("n1", "ready"), ("n2", "pending")]
    w.rec.uncordon("n1")
    follow(w)
    # n1's replica counts again; the surge became the surplus and is scaled down.
    assert nodes_of(w, "a") == [("n1", "ready")]


def test_holds_restored_after_a_restart_apply_at_once():
    w = World(catalog(model("a", replicas=1)), settle=0)
    w.rec.maintenance.restore({"n1": False, "n2": True}, w.clock.now)
    for node in ("n1", "n2", "n3"):
        w.report(node)
    assert w.rec.maintenance.state("n1") == Scheduling.CORDONED
    assert w.rec.maintenance.state("n2") == Scheduling.DRAINED
    converge(w, nodes=("n1", "n2", "n3"))
    assert nodes_of(w, "a") == [("n3", "ready")]


def test_status_rows_show_the_scheduling():
    w = started(catalog(model("a", replicas=1)))
    w.report("n2")
    w.rec.cordon("n2")
    w.step()
    rows = {n.name: n.to_dict()["scheduling"] for n in w.rec.fleet_status().nodes}
    assert rows == {"n1": "schedulable", "n2": "cordoned"}
    w.rec.drain("n2")
    rows = {n["name"]: n["scheduling"] for n in w.rec.status()["nodes"]}
    assert rows == {"n1": "schedulable", "n2": "drained"}


def test_a_restart_during_a_drain_keeps_the_replacement_not_the_drained_replica():
    w = started(catalog(model("a", replicas=1)))
    w.report("n2")
    w.step()
    w.rec.drain("n1")
    w.step()
    w.agent_follows("n2")
    # Before the old replica is taken out, the controller restarts: both are adopted.
    fresh = World(w.live.current, settle=30)
    fresh.running = w.running
    fresh.rec.restore_holds({"n1": True})
    fresh.quiet_pass(0)
    for _ in range(2):
        fresh.report("n1")
        fresh.report("n2")
        fresh.quiet_pass(8)
    assert fresh.rec.settled
    fresh.step()
    # The surplus of what was adopted is the drained node's replica, never the replacement.
    assert nodes_of(fresh, "a") in ([("n1", "stopping"), ("n2", "ready")], [("n2", "ready")])
