"""Issue 15 in place(): model priority and preemption, GPU memory fit and sharing, back to the best profile,
and reasons that say what to do (and whether waiting helps)."""
from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.placement import SCALED_DOWN, Running, place

from .helpers import apply, catalog, memory_node, node, profile, replica

GIB = 1024


def prio_model(name, priority, lo=1, hi=None, gpus=8, memory=None, pool="h100", fallback=False):
    profiles = [Profile("h100", "vllm", pool=pool, gpus=gpus, priority=10, gpu_memory_mib=memory)]
    if fallback:
        profiles.append(Profile("cpu", "llamacpp", gpus=0, priority=1))
    return Model(name, tuple(profiles), source=f"org/{name}", replicas=Replicas(lo, hi if hi is not None else lo),
                 priority=priority)


def ready(rs):
    return [Running(**{**{f: getattr(r, f) for f in Running.__slots__}, "ready": True}) for r in rs]


def starts(plan):
    return [(a.model, a.profile, a.node, a.gpu_indices) for a in plan.start]


# -- priority and preemption -------------------------------------------------------------------

def test_higher_priority_gets_free_room_first_whatever_the_catalog_order():
    cat = Catalog([prio_model("dev", 0), prio_model("prod", 10)])
    plan = place(cat, [node("x")], [], {})
    assert starts(plan) == [("prod", "h100", "x", tuple(range(8)))]
    assert [u.model for u in plan.unplaceable] == ["dev"]


def test_equal_priority_keeps_catalog_order_and_never_preempts():
    cat = Catalog([prio_model("a", 5), prio_model("b", 5)])
    running = ready([replica("r1", "a", "x", gpus=range(8))])
    plan = place(cat, [node("x")], running, {})
    assert plan.stop == () and plan.start == ()
    assert plan.unplaceable[0].reason.endswith("GPUs held by a (priority 5, 8 GPUs)")


def test_min_of_a_higher_priority_model_preempts_a_lower_one_that_makes_it_fit():
    cat = Catalog([prio_model("dev", 0), prio_model("prod", 10)])
    running = ready([replica("d1", "dev", "x", gpus=range(8))])
    plan = place(cat, [node("x")], running, {})
    assert [(s.replica_id, s.preempted_by) for s in plan.stop] == [("d1", "prod")]
    assert plan.stop[0].reason == "preempted by prod (priority 10) to place its minimum of 1"
    (u,) = plan.unplaceable
    assert u.model == "prod" and not u.permanent and u.reason.startswith("preempting dev (priority 0, d1) on x")

    # While d1 drains (leaving), nothing more is preempted: its room is coming free.
    draining = [Running(**{**{f: getattr(r, f) for f in Running.__slots__}, "leaving": True}) for r in running]
    plan = place(cat, [node("x")], draining, {})
    assert plan.stop == () and plan.start == ()
    why = {u.model: u.reason for u in plan.unplaceable}
    assert why["prod"].startswith("waiting for dev (priority 0, d1) to leave x")

    # Once gone, the preemptor takes the room, not the victim (which is now short itself).
    plan = place(cat, [node("x")], [], {})
    assert starts(plan) == [("prod", "h100", "x", tuple(range(8)))]
    assert [u.model for u in plan.unplaceable] == ["dev"]
    # And the victim, lower, never preempts back.
    plan = place(cat, [node("x")], ready(apply(plan, [])), {})
    assert plan.stop == () and plan.start == ()
    assert "GPUs held by prod (priority 10, 8 GPUs)" in plan.unplaceable[0].reason


def test_preemption_serves_only_the_minimum_never_a_scale_up():
    cat = Catalog([prio_model("dev", 0), prio_model("prod", 10, lo=1, hi=2, gpus=4)])
    running = ready([replica("p1", "prod", "x", gpus=range(4)), replica("d1", "dev", "y", gpus=range(8))])
    plan = place(cat, [node("x", gpus=4), node("y")], running, {"prod": 2})
    assert plan.stop == () and [u.model for u in plan.unplaceable] == ["prod"]


def test_no_preemption_when_freeing_would_not_make_it_fit():
    # The victim is on a 4-GPU node: freeing it gives 4, prod needs 8.
    cat = Catalog([prio_model("dev", 0, gpus=4), prio_model("prod", 10)])
    running = ready([replica("d1", "dev", "x", gpus=range(4))])
    plan = place(cat, [node("x", gpus=4)], running, {})
    assert plan.stop == ()
    assert plan.unplaceable[0].permanent        # and it says so: the largest node has 4


def test_victims_are_the_fewest_lowest_priority_surplus_first_on_one_node():
    cat = Catalog([prio_model("low", 0, lo=1, hi=4, gpus=2), prio_model("mid", 5, lo=1, hi=2, gpus=2),
                   prio_model("prod", 10, gpus=4)])
    running = ready([replica("l1", "low", "x", gpus=(0, 1)), replica("l2", "low", "x", gpus=(2, 3)),
                     replica("m1", "mid", "x", gpus=(4, 5)), replica("m2", "mid", "x", gpus=(6, 7))])
    plan = place(cat, [node("x")], running, {"low": 2, "mid": 2})
    # low's two replicas (one above its min, one its min) free exactly four: mid is left alone.
    assert sorted(s.replica_id for s in plan.stop) == ["l1", "l2"]
    assert {s.preempted_by for s in plan.stop} == {"prod"}


def test_a_victim_may_go_below_its_own_minimum():
    cat = Catalog([prio_model("dev", 0, lo=1), prio_model("prod", 10, lo=1)])
    plan = place(cat, [node("x")], ready([replica("d1", "dev", "x", gpus=range(8))]), {})
    assert [s.replica_id for s in plan.stop] == ["d1"]


def test_a_stale_victim_is_stopped_once_and_its_room_goes_to_the_preemptor():
    # dev's only replica is on an old profile and holds all of x. prod preempts it; dev is
    # short too, but rule 5's stop-then-start must not stop the same replica a second time.
    cat = Catalog([prio_model("dev", 0), prio_model("prod", 10)])
    running = ready([replica("d1", "dev", "x", gpus=range(8), current=False)])
    plan = place(cat, [node("x")], running, {})
    assert [(s.replica_id, s.preempted_by) for s in plan.stop] == [("d1", "prod")]
    assert plan.keep == () and sorted(u.model for u in plan.unplaceable) == ["dev", "prod"]
    # Once d1 is gone, the preemptor gets the room, not the victim's model.
    plan = place(cat, [node("x")], apply(plan, running), {})
    assert starts(plan) == [("prod", "h100", "x", tuple(range(8)))] and plan.stop == ()
    assert [u.model for u in plan.unplaceable] == ["dev"]


def test_a_stale_victim_whose_replacement_starts_elsewhere_costs_its_model_nothing():
    # dev's old-profile replica holds x; its replacement fits on the GPU-less fallback at
    # once, and prod preempts the old one. dev gets its wanted replica: the preemption took
    # a replica that was never counted toward dev's wanted, so nothing of dev is short.
    cat = Catalog([prio_model("dev", 0, fallback=True), prio_model("prod", 10)])
    running = [replica("d1", "dev", "x", gpus=range(8), current=False)]
    plan = place(cat, [node("x")], running, {})
    assert starts(plan) == [("dev", "cpu", "x", ())]
    assert [(s.replica_id, s.preempted_by) for s in plan.stop] == [("d1", "prod")]
    assert [u.model for u in plan.unplaceable] == ["prod"]
    plan = place(cat, [node("x")], apply(plan, running), {})
    assert starts(plan) == [("prod", "h100", "x", tuple(range(8)))] and plan.stop == () and plan.unplaceable == ()


def test_memory_preemption_frees_only_the_share_it_needs():
    cat = Catalog([prio_model("small", 0, lo=2, hi=2, gpus=1, memory=10 * GIB),
                   prio_model("prod", 10, gpus=1, memory=12 * GIB)])
    running = ready([replica("s1", "small", "x", gpus=(0,), memory_mib=10 * GIB),
                     replica("s2", "small", "x", gpus=(0,), memory_mib=10 * GIB)])
    plan = place(cat, [memory_node("x", gib=(24,), free=(4,))], running, {})
    # 24 GiB with 20 taken by small: freeing one of them leaves 14 >= 12.
    assert len(plan.stop) == 1 and plan.stop[0].preempted_by == "prod"


def test_no_preemption_of_a_starting_whole_gpu_replica_for_memory_held_outside_llmgw():
    # 16 of GPU 0's 24 GiB are held outside llmgw, so prod (16 GiB) cannot fit there even alone.
    # dev took the GPU whole and is still starting: what is used is not dev's yet, so stopping
    # dev frees 8 GiB, not 24 -- preempting it would only have dev placed again next pass.
    cat = Catalog([prio_model("dev", 0, gpus=1), prio_model("prod", 10, gpus=1, memory=16 * GIB)])
    nodes = [memory_node("x", gib=(24,), free=(8,))]
    running = [replica("d1", "dev", "x", gpus=(0,))]
    plan = place(cat, nodes, running, {})
    assert plan.stop == () and plan.start == () and [u.model for u in plan.unplaceable] == ["prod"]
    # Once dev serves, the report cannot tell its memory from anyone else's on a GPU it holds
    # whole: preemption takes it as dev's, as before.
    assert [s.preempted_by for s in place(cat, nodes, ready(running), {}).stop] == ["prod"]


# -- GPU memory -----------------------------------------------------------------------------

def test_memory_profiles_share_a_gpu_while_their_needs_fit():
    cat = Catalog([prio_model("a", 0, lo=3, hi=3, gpus=1, memory=10 * GIB)])
    plan = place(cat, [memory_node("x", gib=(24,))], [], {})
    # Two of 10 GiB fit in 24; the third does not, and the reason names memory.
    assert starts(plan) == [("a", "h100", "x", (0,)), ("a", "h100", "x", (0,))]
    (u,) = plan.unplaceable
    assert "the most free GPU memory is 4 GiB; needs 10 GiB per GPU" in u.reason and not u.permanent
    # Applied (starting, not yet allocated), the next pass changes nothing.
    again = place(cat, [memory_node("x", gib=(24,))], apply(plan, [], cat), {})
    assert again.start == () and again.stop == ()


def test_memory_fit_uses_what_is_free_not_only_the_total():
    cat = Catalog([prio_model("a", 0, gpus=1, memory=20 * GIB)])
    nodes = [memory_node("x", gib=(24, 24), free=(16, 22))]
    assert starts(place(cat, nodes, [], {})) == [("a", "h100", "x", (1,))]
    nodes = [memory_node("x", gib=(24, 24), free=(16, 16))]
    assert "the most free GPU memory is 16 GiB; needs 20 GiB per GPU" in place(cat, nodes, [], {}).unplaceable[0].reason


def test_a_gpu_too_small_is_a_permanent_reason():
    cat = Catalog([prio_model("big", 0, gpus=1, memory=40 * GIB)])
    (u,) = place(cat, [memory_node("x", gib=(24, 24))], [], {}).unplaceable
    assert u.permanent and u.reason == ("profile h100 (vllm, 1 GPU x 40 GiB, pool h100): the largest GPU in pool h100 "
                                        "has 24 GiB; this profile needs 40 GiB per GPU, so it can never be placed")


def test_memory_packs_shared_gpus_first_and_keeps_whole_ones_whole():
    cat = Catalog([prio_model("small", 0, lo=2, hi=2, gpus=1, memory=8 * GIB),
                   prio_model("whole", 0, lo=1, gpus=1)])
    plan = place(cat, [memory_node("x", gib=(24, 24))], [], {})
    # Both small replicas go on GPU 0 (the fullest that fits), the whole-GPU one on GPU 1.
    assert sorted(starts(plan)) == [("small", "h100", "x", (0,)), ("small", "h100", "x", (0,)),
                                    ("whole", "h100", "x", (1,))]


def test_whole_gpu_profiles_never_share_and_unknown_memory_is_never_shared():
    cat = Catalog([prio_model("small", 0, gpus=1, memory=4 * GIB), prio_model("whole", 0, gpus=1)])
    running = ready([replica("w1", "whole", "x", gpus=(0,))])
    plan = place(cat, [memory_node("x", gib=(24,))], running, {})
    assert plan.start == () and "small" in {u.model for u in plan.unplaceable}
    # A node that reports no memory takes whole-GPU profiles only.
    plan = place(cat, [node("y", gpus=2)], [], {})
    assert starts(plan) == [("whole", "h100", "y", (0,))]
    (u,) = plan.unplaceable
    assert u.model == "small" and u.permanent and "no node in pool h100 reports the memory" in u.reason


# -- back to the best profile ----------------------------------------------------------------------

def test_fallback_is_replaced_by_surge_and_stopped_only_once_the_better_one_is_ready():
    cat = Catalog([prio_model("a", 0, gpus=1, fallback=True)])
    running = ready([replica("r1", "a", "x", gpus=(), profile="cpu")])
    plan = place(cat, [node("x")], running, {})
    assert starts(plan) == [("a", "h100", "x", (0,))] and plan.start[0].replaces == "r1" and plan.stop == ()
    running = apply(plan, running, cat)
    # The better one is starting: the fallback keeps serving, and no second surge.
    plan = place(cat, [node("x")], running, {})
    assert plan.start == () and plan.stop == ()
    plan = place(cat, [node("x")], ready(running), {})
    assert [(s.replica_id, s.reason) for s in plan.stop] == [("r1", SCALED_DOWN)] and plan.start == ()


def test_no_move_when_not_movable_or_nothing_better_fits():
    cat = Catalog([prio_model("a", 0, gpus=1, fallback=True), prio_model("o", 0, gpus=8)])
    running = ready([replica("r1", "a", "x", gpus=(), profile="cpu"), replica("o1", "o", "x", gpus=range(8))])
    assert place(cat, [node("x")], running, {}).start == ()
    assert place(cat, [node("x", gpus=16)], running, {}, movable={"o"}).start == ()
    assert len(place(cat, [node("x", gpus=16)], running, {}, movable={"a"}).start) == 1


def test_a_short_model_gets_the_room_before_any_move():
    cat = Catalog([prio_model("a", 0, gpus=1, fallback=True), prio_model("b", 0, gpus=1)])
    running = ready([replica("r1", "a", "x", gpus=(), profile="cpu")])
    plan = place(cat, [node("x", gpus=1)], running, {})
    assert starts(plan) == [("b", "h100", "x", (0,))]


# -- reasons ------------------------------------------------------------------------------------

def test_reason_largest_node_too_small_is_permanent_and_says_so():
    cat = catalog(Model("big", (profile(gpus=8),), replicas=Replicas(1, 1)))
    (u,) = place(cat, [node("x", gpus=4), node("y", gpus=4)], [], {}).unplaceable
    assert u.permanent and u.reason == ("profile h100 (vllm, 8 GPUs, pool h100): the largest node in pool h100 "
                                        "that runs vllm has 4 GPUs; this profile needs 8, so it can never be placed")


def test_reason_missing_pool_is_permanent_room_is_transient():
    cat = catalog(Model("a", (profile("a100", pool="a100"),), replicas=Replicas(1, 1)))
    (u,) = place(cat, [node("x")], [], {}).unplaceable
    assert u.permanent and "no node has pool a100" in u.reason
    cat = catalog(Model("a", (profile(gpus=2),), replicas=Replicas(1, 1)), Model("o", (profile(gpus=7),)))
    plan = place(cat, [node("x")], [replica("o1", "o", "x", gpus=range(7))], {"o": 1})
    assert not plan.unplaceable[0].permanent


def test_permanent_only_when_every_profile_is():
    cat = catalog(Model("a", (profile("big", gpus=8), profile("small", gpus=1, priority=1))),
                  Model("o", (profile(gpus=4),)))
    running = [replica("o1", "o", "x", gpus=range(4))]
    (u,) = place(cat, [node("x", gpus=4)], running, {"o": 1}).unplaceable
    assert not u.permanent and "can never be placed" in u.reason and "GPUs held by o (priority 0, 4 GPUs)" in u.reason


def test_unreachable_fleet_is_transient():
    cat = catalog(Model("a", (profile(),)))
    (u,) = place(cat, [node("x", schedulable=False)], [], {}).unplaceable
    assert not u.permanent


# -- the per-node replica cap (issue 13) with memory sharing and preemption -------------------------

def test_memory_sharing_stops_at_the_per_node_replica_cap(monkeypatch):
    from llmgwctl.placement import fleet, reasons
    monkeypatch.setattr(fleet, "MAX_REPLICAS_PER_NODE", 3)
    monkeypatch.setattr(reasons, "MAX_REPLICAS_PER_NODE", 3)
    # Room for 24 replicas of 1 GiB on the GPU, slots for 3 on the node (one held already).
    cat = Catalog([prio_model("small", 0, lo=5, gpus=1, memory=GIB)])
    running = ready([replica("r1", "small", "x", gpus=(0,), memory_mib=GIB)])
    plan = place(cat, [memory_node("x", gib=(24,))], running, {})
    assert [a.node for a in plan.start] == ["x", "x"]
    assert len(plan.unplaceable) == 2 and plan.unplaceable[0] is plan.unplaceable[1]   # one record, shared
    u = plan.unplaceable[0]
    assert "already runs 3 replicas, the most one node runs" in u.reason and not u.permanent
