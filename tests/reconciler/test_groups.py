"""Replicas spanning nodes, one pass at a time: a group placed whole, routed whole, failing and stopping as one.

The reconciler's side of issue 32 with a fake clock and reports written as
agents send them (test_reconciler.World); placement is the real one. A
worker member reports no URL: it serves nothing (the agent never probes it
over HTTP).
"""
from __future__ import annotations

from llmgwctl.cli.status import render
from llmgwctl.contracts import ReplicaState
from llmgwctl.inventory import Inventory
from llmgwctl.reconciler import DesiredStore, Reconciler
from llmgwctl.reconciler.groups import BACKOFF_INITIAL, GROUP_PORTS

from .test_reconciler import World, catalog
from .test_status_rows import control

NODES = ("n1", "n2", "n3", "n4")


def gang(name="big", nodes=2, gpus=2, parallel="pipeline", replicas=1):
    return (f"  - name: {name}\n    replicas: {replicas}\n"
            f"    profiles: [{{name: p, engine: fake, pool: gpu, gpus: {gpus}, nodes: {nodes}, parallel: {parallel}}}]\n")


class GangWorld(World):
    def follow_all(self, rounds=3, states=None):
        for _ in range(rounds):
            self.step()
            for node in self.alive:
                self.agent_follows(node, states=states)
        self.step()

    def members(self):
        return sorted((r.spec.group.rank, r.node, r.state) for r in self.rec.replicas.values() if r.spec.group)


def world(*models, nodes=NODES):
    w = GangWorld(catalog(*models), settle=0)
    for n in nodes:
        w.report(n)
    return w


def test_a_two_node_model_is_placed_whole_on_two_nodes_with_every_slot_decided_before_it_starts():
    w = world(gang())
    w.step()
    recs = sorted((r for r in w.rec.replicas.values()), key=lambda r: r.spec.group.rank)
    assert [r.spec.group.rank for r in recs] == [0, 1] and len({r.node for r in recs}) == 2
    head, worker = recs
    assert worker.spec.id == f"{head.spec.id}-r1" and head.spec.group.group == worker.spec.group.group == head.spec.id
    assert head.spec.group == worker.spec.group.__class__(**{**worker.spec.group.to_dict(), "rank": 0})
    assert head.spec.group.head_host == head.node and head.spec.group.port in GROUP_PORTS
    assert head.spec.group.size == 2 and head.spec.group.parallel == "pipeline" and head.spec.gpus == 2
    # Each member is on its own node's desired list, with its slot: nothing is left for an agent to decide.
    assert [s.id for s in w.desired.get(head.node)[1]] == [head.spec.id]
    assert [s.group.rank for s in w.desired.get(worker.node)[1]] == [1]
    assert any(e.kind == "replica-placed" and "across 2 nodes" in e.message for e in w.rec.events)


def test_the_group_is_routed_through_its_head_only_while_every_member_is_ready():
    w = world(gang())
    w.step()
    head = next(r for r in w.rec.replicas.values() if r.spec.group.rank == 0)
    worker_id = f"{head.spec.id}-r1"
    w.follow_all(states={worker_id: "starting"})
    assert head.state == ReplicaState.READY and w.rec.endpoints == (), "a half group takes no request"
    w.follow_all(states={worker_id: "ready"})
    (ep,) = w.rec.endpoints
    assert ep.replica_id == head.spec.id and ep.model == "big"
    status = w.rec.status()
    (row,) = status["replicas"]
    assert row["id"] == head.spec.id and [m["rank"] for m in row["members"]] == [0, 1]
    assert {m["state"] for m in row["members"]} == {"ready"}
    (model,) = status["models"]
    assert (model["ready"], model["replicas"]) == (1, 1), "a group counts once"
    # `llmgwctl status`: one row, its members on a line under it.
    text = render(control(w).to_dict(), now=w.clock.now)
    worker = w.rec.replicas[worker_id]
    assert text.count(head.spec.id) >= 2 and f"{head.spec.id} spans 2 nodes: rank 0 {head.node}" in text
    assert f"rank 1 {worker.node} GPUs 0,1 ready" in text


def test_a_failed_member_stops_the_whole_group_which_is_placed_again_after_a_back_off():
    w = world(gang())
    w.step()
    head = next(r for r in w.rec.replicas.values() if r.spec.group.rank == 0)
    w.follow_all()
    assert w.rec.endpoints
    worker_id = f"{head.spec.id}-r1"
    w.follow_all(rounds=1, states={worker_id: "failed"})
    assert w.rec.endpoints == (), "the group left the routing with its failed member"
    assert {r.state for r in w.rec.replicas.values() if r.spec.group.group == head.spec.id} == {ReplicaState.STOPPING}
    failed = [e for e in w.rec.events if e.kind == "group-failed"]
    assert len(failed) == 1 and worker_id in failed[0].message
    # The agents stop them; nothing new is placed until the back-off is over.
    w.follow_all(rounds=1)
    assert not any(r.spec.group.group == head.spec.id for r in w.rec.replicas.values())
    assert "back-off" in w.rec.unplaceable["big"], "status says why nothing is placed yet"
    assert w.rec.replicas == {} or all(r.created >= failed[0].at + BACKOFF_INITIAL for r in w.rec.replicas.values())
    for _ in range(int(BACKOFF_INITIAL) + 2):
        w.step()
    again = [r for r in w.rec.replicas.values() if r.spec.group]
    assert len(again) == 2 and {r.spec.group.group for r in again} != {head.spec.id}


def test_a_members_node_lost_takes_the_group_out_of_routing_at_once():
    w = world(gang())
    w.step()
    w.follow_all()
    worker = next(r for r in w.rec.replicas.values() if r.spec.group.rank == 1)
    assert w.rec.endpoints
    w.alive.discard(worker.node)
    for _ in range(17):         # past the node timeout (15 s)
        w.step()
    assert all(ep.model != "big" or ep.replica_id != worker.spec.group.group for ep in w.rec.endpoints)
    assert any(e.kind == "group-failed" for e in w.rec.events)


def test_a_restarted_controller_adopts_a_whole_group_and_stops_a_partial_one():
    w = world(gang(), gang("half"))
    w.step()
    w.follow_all()
    before = {r.spec.id: r.node for r in w.rec.replicas.values()}
    assert len(before) == 4
    half_worker = next(r for r in w.rec.replicas.values() if r.spec.model == "half" and r.spec.group.rank == 1)
    # A new controller; the half model's worker's node never reports again.
    w.alive.discard(half_worker.node)
    w.running[half_worker.node].pop(half_worker.spec.id)
    # Its inventory starts empty: it knows only what agents report to it.
    w.inventory, w.desired = Inventory(clock=w.clock, unreachable_after=15), DesiredStore()
    w.rec = Reconciler(w.live, w.inventory, w.desired, endpoints=w.sink, usage=w.usage, clock=w.clock,
                       wall_clock=w.clock, settle=5, drain_grace=30, replace_after=60)
    for _ in range(8):
        w.step()
        for node in list(w.alive):
            w.agent_follows(node)
    kept = {rid for rid, r in w.rec.replicas.items() if r.spec.model == "big"}
    assert kept == {rid for rid in before if rid.startswith("big")} and all(w.rec.replicas[r].adopted for r in kept)
    assert any(ep.model == "big" for ep in w.rec.endpoints)
    assert not any(r.spec.id == half_worker.spec.group.group and r.adopted and r.state != ReplicaState.STOPPING
                   for r in w.rec.replicas.values()), "the half group's head was not kept"
    assert any(e.kind == "group-failed" and "half" in e.message for e in w.rec.events)


def test_a_group_scaled_away_drains_its_head_then_stops_its_workers():
    w = world(gang())
    w.step()
    w.follow_all()
    w.live.swap(catalog(gang(replicas=0)))
    w.step()
    head = next(r for r in w.rec.replicas.values() if r.spec.group.rank == 0)
    worker = next(r for r in w.rec.replicas.values() if r.spec.group.rank == 1)
    assert head.state in (ReplicaState.DRAINING, ReplicaState.STOPPING)
    w.step()
    assert head.state == ReplicaState.STOPPING and worker.state == ReplicaState.STOPPING
    assert w.rec.endpoints == ()


def test_a_model_that_needs_more_nodes_than_the_fleet_has_starts_nothing():
    w = world(gang(nodes=3), nodes=("n1", "n2"))
    w.step()
    assert w.rec.replicas == {}
    assert "big" in w.rec.unplaceable


def test_draining_a_workers_node_moves_the_whole_group_surge_first():
    w = world(gang())
    w.step()
    w.follow_all()
    old = next(r for r in w.rec.replicas.values() if r.spec.group.rank == 0)
    worker = w.rec.replicas[f"{old.spec.id}-r1"]
    assert w.rec.drain(worker.node)
    w.step()
    new = [r for r in w.rec.replicas.values() if r.spec.group.group != old.spec.id]
    assert len(new) == 2 and worker.node not in {r.node for r in new}, "a new group placed off the draining node"
    assert old.state == ReplicaState.READY and w.rec.endpoints, "the old group serves until the new one does"
    w.follow_all()
    w.follow_all()
    eps = {ep.replica_id for ep in w.rec.endpoints}
    assert eps == {next(r.spec.id for r in new if r.spec.group.rank == 0)}
    assert old.spec.id not in w.rec.replicas and worker.spec.id not in w.rec.replicas, "the old group stopped whole"
    assert not any(e.kind == "group-failed" for e in w.rec.events), "a drain is not a failure"
