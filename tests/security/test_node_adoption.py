"""A node adds to the fleet only what it was given: the adoption rules, one pass at a time.

The attacker holds one genuine node token and reports, with a spec computed by
llmgw's own code from the catalog (catalogs live in git), a `ready` replica of
a model that already serves elsewhere. After the settling window nothing the
controller did not place on that node is adopted; within it, only what fits
the node's pools and GPUs, and a newcomer never displaces an elder.
The end-to-end attacks, through a real serve, are in test_node_trust.py.
"""
from __future__ import annotations

from llmgwctl.contracts import ReplicaSpec
from llmgwctl.contracts.claims import NodeClaims
from tests.reconciler.test_reconciler import World, catalog, converge, model, run_report


def forged(w: World, model_name: str, rid: str, gpus: tuple[int, ...] = (0,), state: str = "ready",
           port: int = 29001) -> dict:
    """A replica report an attacker computes from the catalog with llmgw's own code."""
    m = w.live.current.resolve(model_name)
    profile = m.profiles[0]
    spec = ReplicaSpec.for_profile(rid, m, profile, w.live.current.engines[profile.engine], gpus)
    return run_report(spec, state, port)


def events(w: World, kind: str) -> list[str]:
    return [e.message for e in w.rec.events if e.kind == kind]


def test_after_the_window_an_unplaced_ready_replica_is_not_adopted_and_gets_no_traffic():
    w = World(catalog(model("chat", replicas=1)), settle=0)
    w.report("real")
    converge(w, nodes=("real",))
    (real,) = [r.spec.id for r in w.rec.replicas.values()]
    # The attacker's node: never placed anything; a lower id than the real one, ready at once.
    w.running["evil"] = {"aaaa-0": forged(w, "chat", "aaaa-0")}
    w.report("evil")
    for _ in range(3):
        w.step()
        w.agent_follows("real")
    assert set(w.rec.replicas) == {real}, "nothing adopted, the real replica kept"
    assert [e.replica_id for e in w.rec.endpoints] == [real]
    assert w.rec.replicas[real].state == "ready"
    assert w.desired.get("evil")[1] == (), "a genuine agent on that node is told to stop it"
    (said,) = events(w, "replica-refused")
    assert "aaaa-0" in said and "settling window is over" in said and "evil" in said


def test_a_node_back_from_a_loss_still_gets_its_own_replica_back():
    w = World(catalog(model("a", replicas=1)), settle=0)
    w.report("n1")
    converge(w)
    (rid,) = w.rec.replicas
    saved = dict(w.running["n1"])
    w.alive.discard("n1")
    for _ in range(80):         # past the node timeout and replace_after: given up on
        w.step()
    assert rid not in w.rec.replicas
    w.running["n1"] = saved
    w.report("n1")
    w.step()
    assert rid in w.rec.replicas, "its own replica, back with it, is adopted again"
    assert not events(w, "replica-refused")


def test_a_given_up_replica_reported_by_another_node_is_not_adopted():
    w = World(catalog(model("a", replicas=1)), settle=0)
    w.report("n1")
    converge(w)
    (rid,) = w.rec.replicas
    saved = dict(w.running["n1"])
    w.alive.discard("n1")
    for _ in range(80):
        w.step()
    w.running["n2"] = saved     # a copied state directory, or an attacker who read the id
    w.report("n2")
    w.step()
    assert rid not in w.rec.replicas
    assert any(rid in m for m in events(w, "replica-refused"))


def test_within_the_window_a_replica_off_the_nodes_pools_or_gpus_is_not_adopted():
    w = World(catalog(model("gpu-model", pool="h100", gpus=2)), settle=30)
    w.quiet_pass(0)
    # A pool it does not hold, GPUs it does not have, and a spec that is another replica's.
    wrong_pool = forged(w, "gpu-model", "r-pool", gpus=(0, 1))
    missing_gpus = forged(w, "gpu-model", "r-gpus", gpus=(6, 7))
    other_spec = dict(forged(w, "gpu-model", "r-spec", gpus=(0, 1)), id="r-renamed")
    w.running["n1"] = {"r-pool": wrong_pool}
    w.report("n1", gpus=2, pools=("a100",))
    w.running["n2"] = {"r-gpus": missing_gpus}
    w.report("n2", gpus=2, pools=("h100",))
    w.running["n3"] = {"r-renamed": other_spec}
    w.report("n3", gpus=2, pools=("h100",))
    w.quiet_pass()
    assert w.rec.replicas == {}
    said = " ".join(events(w, "replica-refused"))
    assert "pool 'h100' is not one node n1 may claim" in said
    assert "GPUs [6, 7] are not GPUs node n2 may claim" in said
    assert "not of the replica reported" in said


def test_within_the_window_a_gpu_held_by_an_adopted_replica_is_not_adopted_again():
    w = World(catalog(model("a", gpus=1, replicas=2)), settle=30)
    w.quiet_pass(0)
    w.running["n1"] = {"first": forged(w, "a", "first", gpus=(0,))}
    w.report("n1")
    w.quiet_pass()
    w.running["n1"]["second"] = forged(w, "a", "second", gpus=(0,), port=29002)
    w.report("n1")
    w.quiet_pass()
    assert set(w.rec.replicas) == {"first"}
    assert any("GPU 0 of node n1 is held by first" in m for m in events(w, "replica-refused"))


def test_within_the_window_a_newcomer_never_displaces_the_replica_adopted_before_it():
    w = World(catalog(model("chat", pool="any", gpus=0, replicas=1)), settle=30)
    w.quiet_pass(0)
    w.running["real"] = {"zzzz-real": forged(w, "chat", "zzzz-real", gpus=())}
    w.report("real", pools=("any",))
    w.quiet_pass()
    # Later in the window, another node of the pool reports one with a lower id, ready too.
    w.running["evil"] = {"aaaa-evil": forged(w, "chat", "aaaa-evil", gpus=(), port=29002)}
    w.report("evil", pools=("any",))
    w.quiet_pass(2)
    assert set(w.rec.replicas) == {"zzzz-real", "aaaa-evil"}
    for _ in range(20):         # the window ends; the surplus is trimmed
        w.step()
    assert w.rec.replicas["zzzz-real"].state == "ready"
    assert w.rec.replicas.get("aaaa-evil") is None or w.rec.replicas["aaaa-evil"].state in ("draining", "stopping")
    assert [e.replica_id for e in w.rec.endpoints] == ["zzzz-real"]


def test_claims_cut_a_report_to_what_the_token_allows():
    w = World(catalog(model("big", pool="h100", gpus=8)), settle=0)
    body = {"node": "evil", "pools": ["h100", "spare"], "engines": {"fake": {"available": True, "reason": ""}},
            "gpus": [{"index": i, "name": "H100", "memory_mib": 81920} for i in range(8)], "replicas": []}
    node, _ = w.inventory.report("evil", body, NodeClaims(pools=frozenset({"spare"}), max_gpus=2))
    assert node.pools == frozenset({"spare"}) and [g.index for g in node.gpus] == [0, 1]
    assert any("pool 'h100'" in r for r in node.refused) and any("6 of 8 GPUs" in r for r in node.refused)
    for _ in range(3):
        w.quiet_pass()
    assert w.rec.replicas == {}, "nothing placed on what the token does not allow"
    assert "big" in w.rec.unplaceable
    (row,) = [n for n in w.rec.status()["nodes"] if n["name"] == "evil"]
    assert row["pools"] == ["spare"] and row["gpus"] == 2 and len(row["refused"]) == 2
