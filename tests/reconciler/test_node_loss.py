"""Node loss without churn (issue 15): replace at the node timeout what nothing else serves, adopt what comes back.

One pass at a time with a fake clock, as in test_reconciler; the end-to-end
form (real agents, SIGKILL) is in tests/faults/test_node_loss.py.
"""
from .test_reconciler import World, catalog, converge, model


def lose(w, node, seconds, *others):
    w.alive.discard(node)
    w.clock.now += seconds
    for other in others:
        w.agent_follows(other)
    w.rec.reconcile_once()


def lone_replica_lost():
    """A one-replica model on one of two nodes, that node then silent for 16 s: (world, replica, its node, the other).

    16 s: past the 15 s node timeout, far inside the 60 s grace.
    """
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    w.report("n2")
    converge(w, nodes=("n1", "n2"))
    (replica,) = w.rec.replicas.values()
    lost, other = replica.node, "n2" if replica.node == "n1" else "n1"
    lose(w, lost, 16, other)
    return w, replica, lost, other


def test_single_replica_model_is_replaced_at_the_node_timeout_not_after_the_grace():
    w, _, _, other = lone_replica_lost()
    assert [(r.node, r.state) for r in w.rec.replicas.values()] == [(other, "pending")]
    assert any(e.kind == "replica-replaced" and "no other replica serves it" in e.message for e in w.rec.events)


def test_replica_of_a_model_still_served_elsewhere_waits_for_the_grace():
    w = World(catalog(model("a", replicas=2, gpus=2)), settle=0)
    w.report("n1")
    w.report("n2")
    w.report("n3")
    converge(w, nodes=("n1", "n2", "n3"))
    nodes = sorted(r.node for r in w.rec.replicas.values())
    lost = nodes[0]
    spare = ({"n1", "n2", "n3"} - set(nodes)).pop()
    rest = [n for n in ("n1", "n2", "n3") if n != lost]
    lose(w, lost, 16, *rest)
    assert sorted(r.state for r in w.rec.replicas.values()) == ["lost", "ready"]
    assert not any(r.node == spare for r in w.rec.replicas.values()), "a flapping node must not reshuffle"
    lose(w, lost, 61, *rest)
    assert sorted(r.node for r in w.rec.replicas.values()) == sorted(rest)


def test_node_back_with_a_replaced_replica_keeps_the_one_that_served_meanwhile():
    w, old, lost, other = lone_replica_lost()
    for _ in range(3):
        w.step()
        w.agent_follows(other)
    (new,) = w.rec.replicas.values()
    assert new.node == other and new.state == "ready"
    w.report(lost)              # back, still running the old engine, healthy
    w.step()
    assert {r.spec.id: r.state for r in w.rec.replicas.values()} == {new.spec.id: "ready", old.spec.id: "stopping"}
    assert w.desired.get(lost)[1] == ()
    assert [e.replica_id for e in w.rec.endpoints] == [new.spec.id]


def small_step(w, seconds=1.0):
    """A pass where n1 reports as World does, and n2 as a node without GPUs."""
    w.clock.now += seconds
    for node in w.alive:
        w.report(node)
    w.report("n2", gpus=0)
    w.rec.reconcile_once()


def lose_n1_with_nowhere_to_go():
    # n2 has no GPU: the lost replica cannot be replaced anywhere.
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    converge(w, nodes=("n1",))
    (old,) = w.rec.replicas.values()
    w.alive.discard("n1")
    small_step(w, 16)
    assert w.rec.replicas == {} and "a" in w.rec.unplaceable
    return w, old


def test_node_back_with_an_engine_that_had_nowhere_else_to_go_keeps_it():
    w, old = lose_n1_with_nowhere_to_go()
    w.report("n1")              # the agent is back (restarted), its engine still up and healthy
    small_step(w)
    (back,) = w.rec.replicas.values()
    assert (back.spec.id, back.node, back.state) == (old.spec.id, "n1", "ready")
    assert [s.id for s in w.desired.get("n1")[1]] == [old.spec.id], "the agent must not be told to stop it"
    assert [e.replica_id for e in w.rec.endpoints] == [old.spec.id]
    assert "a" not in w.rec.unplaceable
    assert sum(e.kind == "replica-placed" for e in w.rec.events) == 1


def test_node_back_with_a_failed_engine_has_it_stopped_and_placed_anew():
    w, old = lose_n1_with_nowhere_to_go()
    w.running["n1"][old.spec.id]["state"] = "failed"
    w.report("n1")
    small_step(w)
    assert old.spec.id not in w.rec.replicas
    assert old.spec.id not in {s.id for s in w.desired.get("n1")[1]}
