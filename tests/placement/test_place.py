"""place() on hand-built fleets: each rule of the placement docstring, with exact plans and reasons."""
import pytest

from llmgwctl.placement import (
    MODEL_LEFT,
    REPLACED,
    REPLACED_NO_ROOM,
    SCALED_DOWN,
    Assignment,
    Running,
    Stop,
    Unplaceable,
    place,
)

from .helpers import apply, catalog, model, node, profile, replica


def starts(plan):
    return [(a.model, a.profile, a.node, a.gpu_indices) for a in plan.start]


def stops(plan):
    return [(s.replica_id, s.reason) for s in plan.stop]


# -- where a profile may land ----------------------------------------------------------------

def test_pool_must_match_and_none_means_any_node():
    cat = catalog(model("a", profile("h100", pool="h100")), model("b", profile("any", pool=None)))
    nodes = [node("x", gpus=4, pools=("a100",)), node("y", pools=("h100",))]
    plan = place(cat, nodes, [], {})
    # b's profile has no pool: it may land on the a100 node, and best-fit picks it (4 free < 7 free).
    assert starts(plan) == [("a", "h100", "y", (0,)), ("b", "any", "x", (0,))]


def test_node_must_run_the_engine():
    cat = catalog(model("a", profile("sg", engine="sglang", pool=None)))
    plan = place(cat, [node("x", engines=("vllm",)), node("y", engines=("vllm", "sglang"))], [], {})
    assert starts(plan) == [("a", "sg", "y", (0,))]


def test_unschedulable_node_gets_nothing_new_but_keeps_its_replicas():
    cat = catalog(model("a", lo=2, hi=2))
    nodes = [node("x", schedulable=False), node("y")]
    running = [replica("r1", "a", "x", ready=True)]
    plan = place(cat, nodes, running, {})
    assert starts(plan) == [("a", "h100", "y", (0,))]
    assert plan.keep == ("r1",) and plan.stop == ()


def test_profiles_tried_by_priority_and_fallback_when_the_best_does_not_fit():
    cat = catalog(model("a", profile("cpu", engine="llamacpp", pool=None, gpus=0, priority=1),
                        profile("big", gpus=8, priority=10)))
    nodes = [node("x")]
    plan = place(cat, nodes, [], {"a": 2})
    # The first replica gets the whole machine; the second falls back to the CPU profile, with no GPUs.
    assert starts(plan) == [("a", "big", "x", tuple(range(8))), ("a", "cpu", "x", ())]


def test_zero_gpu_profile_fits_on_a_node_with_every_gpu_taken():
    cat = catalog(model("a", profile("cpu", engine="llamacpp", pool=None, gpus=0)),
                  model("other", profile("h100", gpus=8)))
    running = [replica("r1", "other", "x", gpus=range(8), profile="h100")]
    plan = place(cat, [node("x")], running, {"a": 1, "other": 1})
    assert starts(plan) == [("a", "cpu", "x", ())]


# -- spread, then best-fit -----------------------------------------------------------------

def test_spread_across_nodes_before_doubling_up():
    cat = catalog(model("a"))
    plan = place(cat, [node("x"), node("y"), node("z")], [], {"a": 4})
    assert [a.node for a in plan.start] == ["x", "y", "z", "x"]
    assert [a.gpu_indices for a in plan.start] == [(0,), (0,), (0,), (1,)]


def test_best_fit_prefers_the_fullest_node_that_fits_keeping_whole_machines_free():
    cat = catalog(model("a", profile(gpus=2)), model("other", profile(gpus=5)))
    running = [replica("r1", "other", "y", gpus=range(5))]   # y has 3 free, x has 8
    plan = place(cat, [node("x"), node("y")], running, {"a": 1, "other": 1})
    assert starts(plan) == [("a", "h100", "y", (5, 6))]


def test_spread_beats_best_fit():
    cat = catalog(model("a", profile(gpus=2)), model("other", profile(gpus=5)))
    running = [replica("r1", "other", "y", gpus=range(5)), replica("r2", "a", "y", gpus=(5, 6))]
    plan = place(cat, [node("x"), node("y")], running, {"a": 2, "other": 1})
    assert starts(plan) == [("a", "h100", "x", (0, 1))]


def test_when_every_fitting_node_has_one_the_fewest_replicas_then_best_fit():
    cat = catalog(model("a", profile(gpus=1)))
    running = [replica("r1", "a", "x", gpus=(0,)), replica("r2", "a", "x", gpus=(1,)),
               replica("r3", "a", "y", gpus=(0,))]
    plan = place(cat, [node("x"), node("y")], running, {"a": 4})
    assert starts(plan) == [("a", "h100", "y", (1,))]


def test_gpu_indices_are_the_lowest_adjacent_run():
    cat = catalog(model("a", profile(gpus=2)), model("other", profile(gpus=1)))
    # Free: 1, 3, 4, 6, 7 -> the lowest pair of adjacent indices is 3, 4.
    running = [replica("r1", "other", "x", gpus=(0,)), replica("r2", "other", "x", gpus=(2,)),
               replica("r3", "other", "x", gpus=(5,))]
    plan = place(cat, [node("x")], running, {"a": 1, "other": 3})
    assert starts(plan) == [("a", "h100", "x", (3, 4))]


def test_gpu_indices_fall_back_to_the_lowest_when_none_are_adjacent():
    cat = catalog(model("a", profile(gpus=2)), model("other", profile(gpus=1)))
    running = [replica(f"r{i}", "other", "x", gpus=(i,)) for i in (0, 2, 4, 6)]
    plan = place(cat, [node("x")], running, {"a": 1, "other": 4})
    assert starts(plan) == [("a", "h100", "x", (1, 3))]


def test_round_robin_gives_every_model_its_first_replica_before_any_its_second():
    cat = catalog(model("a", profile(gpus=4)), model("b", profile(gpus=4)))
    plan = place(cat, [node("x")], [], {"a": 2, "b": 2})
    assert starts(plan) == [("a", "h100", "x", (0, 1, 2, 3)), ("b", "h100", "x", (4, 5, 6, 7))]
    assert [u.model for u in plan.unplaceable] == ["a", "b"]


# -- running replicas stay -----------------------------------------------------------------

def test_running_replicas_are_never_moved_in_place_even_on_a_worse_profile():
    # Issue 15 changed this on purpose: a fallback replica is now *replaced* by a
    # surge on the better profile (tests/placement/test_priority_memory.py); it is
    # still never stopped first, and not at all while its model may not move.
    cat = catalog(model("a", profile("big", gpus=1, priority=10),
                        profile("cpu", engine="llamacpp", pool=None, gpus=0, priority=1)))
    running = [replica("r1", "a", "x", gpus=(), profile="cpu", ready=True)]
    plan = place(cat, [node("x")], running, {"a": 1}, movable=())
    assert plan.start == () and plan.stop == () and plan.keep == ("r1",)
    plan = place(cat, [node("x")], running, {"a": 1})
    assert plan.stop == () and plan.keep == ("r1",) and [a.replaces for a in plan.start] == ["r1"]


def test_gpus_of_every_existing_replica_stay_taken_whatever_its_state():
    cat = catalog(model("a", profile(gpus=2)))
    running = [replica("r1", "gone", "x", gpus=(0, 1)),                       # being stopped now
               replica("r2", "a", "x", gpus=(2, 3), current=False),           # stale
               replica("r3", "a", "x", gpus=(4, 5), failed=True)]             # crash-looping
    plan = place(cat, [node("x")], running, {"a": 2})
    assert starts(plan) == [("a", "h100", "x", (6, 7))]


def test_failed_replicas_count_toward_wanted():
    cat = catalog(model("a"))
    plan = place(cat, [node("x"), node("y")], [replica("r1", "a", "x", failed=True)], {"a": 1})
    assert plan.start == () and plan.keep == ("r1",)


# -- scaling down --------------------------------------------------------------------------

def test_scale_down_order_lowest_priority_then_not_ready_then_newest():
    cat = catalog(model("a", profile("best", priority=10), profile("low", priority=1)))
    running = [
        replica("r-9", "a", "x", gpus=(0,), profile="best", ready=True),
        replica("r-10", "a", "x", gpus=(1,), profile="best", ready=True),   # newer than r-9 (ids compare as numbers)
        replica("r-2", "a", "x", gpus=(2,), profile="best", ready=False),
        replica("r-3", "a", "x", gpus=(3,), profile="low", ready=True),
        replica("r-1", "a", "x", gpus=(4,), profile="low", ready=False),
    ]
    assert stops(place(cat, [node("x")], running, {"a": 4})) == [("r-1", SCALED_DOWN)]
    # r-3 (low, ready) is next, but r-2 on the better profile is still starting and
    # stopping r-3 would leave 2 serving of 3 wanted: it serves until r-2 is ready
    # (issue 15: the rule that finishes a move back to the best profile).
    assert stops(place(cat, [node("x")], running, {"a": 3})) == [("r-1", SCALED_DOWN)]
    ready = running[:2] + [replica("r-2", "a", "x", gpus=(2,), profile="best", ready=True)] + running[3:]
    assert stops(place(cat, [node("x")], ready, {"a": 3})) == [("r-1", SCALED_DOWN), ("r-3", SCALED_DOWN)]
    assert [s for s, _ in stops(place(cat, [node("x")], running, {"a": 1}))] == ["r-1", "r-3", "r-2", "r-10"]
    plan = place(cat, [node("x")], running, {"a": 0})
    assert [s for s, _ in stops(plan)] == ["r-1", "r-3", "r-2", "r-10", "r-9"] and plan.keep == ()


def test_absent_model_wants_its_min():
    cat = catalog(model("a", lo=2, hi=4))
    running = [replica(f"r{i}", "a", "x", gpus=(i,)) for i in range(3)]
    assert stops(place(cat, [node("x")], running, {})) == [("r2", SCALED_DOWN)]


# -- orphans -------------------------------------------------------------------------------

def test_orphans_of_a_removed_model_or_profile_are_stopped_with_why():
    cat = catalog(model("a", profile("h100")))
    running = [replica("r1", "gone", "x", gpus=(0,)), replica("r2", "a", "x", gpus=(1,), profile="old"),
               replica("r3", "a", "x", gpus=(2,))]
    plan = place(cat, [node("x")], running, {"a": 1})
    assert stops(plan) == [("r1", MODEL_LEFT), ("r2", "profile old left model a")]
    assert plan.keep == ("r3",) and plan.start == ()


# -- stale replicas ------------------------------------------------------------------------

def test_stale_surge_places_the_new_one_beside_the_old_and_keeps_the_old():
    cat = catalog(model("a"))
    running = [replica("r1", "a", "x", gpus=(0,), current=False, ready=True)]
    plan = place(cat, [node("x")], running, {"a": 1})
    assert starts(plan) == [("a", "h100", "x", (1,))] and plan.stop == () and plan.keep == ("r1",)
    # The new one is starting: the old one stays until it is ready.
    after = apply(plan, running)
    assert place(cat, [node("x")], after, {"a": 1}).stop == ()
    ready = [r if r.current is False else Running(**{**_fields(r), "ready": True}) for r in after]
    assert stops(place(cat, [node("x")], ready, {"a": 1})) == [("r1", REPLACED)]


def test_stale_stop_then_start_when_there_is_no_room():
    cat = catalog(model("a", profile(gpus=8)))
    running = [replica("r1", "a", "x", gpus=range(8), current=False, ready=True)]
    plan = place(cat, [node("x")], running, {"a": 1})
    assert plan.start == () and stops(plan) == [("r1", REPLACED_NO_ROOM)]
    assert [u.model for u in plan.unplaceable] == ["a"]
    # Next pass: the room is free and the new replica lands in it.
    plan2 = place(cat, [node("x")], apply(plan, running), {"a": 1})
    assert starts(plan2) == [("a", "h100", "x", tuple(range(8)))] and plan2.stop == ()


def test_stale_rolls_one_at_a_time_without_room():
    cat = catalog(model("a", profile(gpus=8)))
    nodes = [node("x"), node("y")]
    running = [replica("r1", "a", "x", gpus=range(8), current=False, ready=True),
               replica("r2", "a", "y", gpus=range(8), current=False, ready=True)]
    plan = place(cat, nodes, running, {"a": 2})
    assert stops(plan) == [("r2", REPLACED_NO_ROOM)]            # newest first, only one
    running = apply(plan, running)
    plan = place(cat, nodes, running, {"a": 2})
    assert starts(plan) == [("a", "h100", "y", tuple(range(8)))] and plan.stop == ()
    running = apply(plan, running)
    # The new one is still starting: r1 keeps serving, nothing is stopped.
    plan = place(cat, nodes, running, {"a": 2})
    assert plan.stop == () and plan.start == ()
    running = [Running(**{**_fields(r), "ready": True}) for r in running]
    assert stops(place(cat, nodes, running, {"a": 2})) == [("r1", REPLACED_NO_ROOM)]


def test_stale_is_not_stopped_when_a_current_replica_is_failing():
    cat = catalog(model("a", profile(gpus=4)))
    running = [replica("r1", "a", "x", gpus=range(4), failed=True),
               replica("r2", "a", "x", gpus=range(4, 8), current=False, ready=True)]
    plan = place(cat, [node("x")], running, {"a": 2})
    assert plan.stop == () and len(plan.unplaceable) == 1


def test_stale_is_not_stopped_when_its_room_would_not_help():
    # The new profile needs pool a100; freeing the stale replica on an h100 node makes no room for it.
    cat = catalog(model("a", profile("a100", pool="a100", gpus=1)))
    running = [replica("r1", "a", "x", gpus=(0,), profile="a100", current=False, ready=True)]
    plan = place(cat, [node("x", pools=("h100",))], running, {"a": 1})
    assert plan.stop == () and plan.unplaceable[0].reason == \
        "profile a100 (vllm, 1 GPU, pool a100): no node has pool a100, so it can never be placed; " \
        "start an agent with --pool a100"
    assert plan.unplaceable[0].permanent


# -- lost replicas -------------------------------------------------------------------------

def test_lost_replicas_do_not_count_and_are_kept():
    cat = catalog(model("a"))
    running = [replica("r1", "a", "gone-node", gpus=(0,), ready=True), replica("r2", "a", "x", gpus=(0,), lost=True)]
    plan = place(cat, [node("x", schedulable=False), node("y")], running, {"a": 1})
    assert starts(plan) == [("a", "h100", "y", (0,))] and plan.keep == ("r1", "r2") and plan.stop == ()


# -- unplaceable reasons -------------------------------------------------------------------

def test_reason_gpus_short_on_one_node():
    cat = catalog(model("a", profile(gpus=2)), model("o", profile(gpus=7)))
    running = [replica("r1", "o", "x", gpus=range(7))]
    plan = place(cat, [node("x")], running, {"a": 1, "o": 1})
    assert [(u.model, u.reason) for u in plan.unplaceable] == [
        ("a", "profile h100 (vllm, 2 GPUs, pool h100): pool h100: 1 of 8 GPUs free on 1 node, needs 2; "
              "GPUs held by o (priority 0, 7 GPUs)")]
    assert not plan.unplaceable[0].permanent


def test_reason_gpus_short_on_several_nodes_one_per_missing_replica():
    cat = catalog(model("a", profile(gpus=4)), model("o", profile(gpus=3)))
    running = [replica("r1", "o", "x", gpus=range(3)), replica("r2", "o", "y", gpus=range(3, 6))]
    plan = place(cat, [node("x"), node("y")], running, {"a": 4, "o": 2})
    # y's free GPUs are 0, 1, 2, 6, 7: no four adjacent, so the lowest four.
    assert starts(plan) == [("a", "h100", "x", (3, 4, 5, 6)), ("a", "h100", "y", (0, 1, 2, 6))]
    # The reason counts what is left once the plan is applied.
    reason = ("profile h100 (vllm, 4 GPUs, pool h100): pool h100: 2 of 16 GPUs free on 2 nodes, at most 1 on one, "
              "needs 4; GPUs held by a (priority 0, 8 GPUs), o (priority 0, 6 GPUs)")
    assert [(u.model, u.reason) for u in plan.unplaceable] == [("a", reason)] * 2


def test_reason_per_profile_best_first():
    cat = catalog(model("a", profile("h100", pool="h100", gpus=2, priority=10),
                        profile("cpu", engine="llamacpp", pool="cpu", gpus=0, priority=1)))
    nodes = [node("c1", pools=("cpu",), engines=("vllm",)), node("c2", pools=("cpu",), engines=("vllm",))]
    plan = place(cat, nodes, [], {"a": 1})
    assert plan.unplaceable[0].reason == (
        "profile h100 (vllm, 2 GPUs, pool h100): no node has pool h100, so it can never be placed; "
        "start an agent with --pool h100; "
        "profile cpu (llamacpp, 0 GPUs, pool cpu): no node in pool cpu can run engine llamacpp (c1, c2 lack it)")


def test_reason_engine_missing_names_a_few_nodes():
    cat = catalog(model("a", profile("cpu", engine="llamacpp", pool=None, gpus=0)))
    nodes = [node(f"n{i}", engines=("vllm",)) for i in range(5)]
    assert place(cat, nodes, [], {}).unplaceable[0].reason == (
        "profile cpu (llamacpp, 0 GPUs, any pool): no node can run engine llamacpp (n0, n1, n2 and 2 more lack it)")


def test_reason_pool_all_unschedulable():
    cat = catalog(model("a", profile(pool="h100")))
    nodes = [node("x", schedulable=False), node("y", pools=("cpu",))]
    assert place(cat, nodes, [], {}).unplaceable[0].reason == (
        "profile h100 (vllm, 1 GPU, pool h100): no schedulable node in pool h100 (1 node, all unreachable or draining)")


def test_reason_no_schedulable_node_at_all():
    cat = catalog(model("a"))
    assert place(cat, [node("x", schedulable=False), node("y", schedulable=False)], [], {}).unplaceable == (
        Unplaceable("a", "no schedulable node (2 nodes, all unreachable or draining)"),)
    assert place(cat, [], [], {}).unplaceable[0].reason == "no node in the inventory (no agent has reported)"


def test_wanted_zero_places_nothing_and_reports_nothing():
    cat = catalog(model("a", lo=0, hi=2))
    assert place(cat, [], [], {}) == place(cat, [node("x")], [], {"a": 0})
    assert place(cat, [], [], {}).unplaceable == ()


# -- idempotence and bad input -------------------------------------------------------------

def test_applying_a_plan_and_placing_again_gives_an_empty_plan():
    cat = catalog(model("a", profile(gpus=2), lo=1, hi=4),
                  model("b", profile("b", pool=None, gpus=4), profile("cpu", engine="llamacpp", pool=None, gpus=0,
                                                                      priority=1)),
                  model("c", profile(gpus=8)))
    nodes = [node("x"), node("y"), node("z", pools=("a100",))]
    running = [replica("old", "gone", "x", gpus=(7,))]
    plan = place(cat, nodes, running, {"a": 3, "b": 3, "c": 2})
    assert plan.start and plan.stop and plan.unplaceable
    after = apply(plan, running)
    again = place(cat, nodes, after, {"a": 3, "b": 3, "c": 2})
    # The stop freed GPU 7 on x: the next pass may use it, but only for what was unplaceable.
    assert again.stop == ()
    final = apply(again, after)
    third = place(cat, nodes, final, {"a": 3, "b": 3, "c": 2})
    assert third.start == () and third.stop == ()
    assert set(third.keep) == {r.replica_id for r in final}


def test_a_plan_without_stops_is_a_fixed_point():
    cat = catalog(model("a", profile(gpus=3)), model("b", profile(gpus=0, engine="llamacpp", pool=None)))
    nodes = [node("x"), node("y")]
    plan = place(cat, nodes, [], {"a": 4, "b": 2})
    # Two of a's 3-GPU replicas fit per 8-GPU node, so a gets all 4 here; 5 would leave one unplaceable.
    assert len(plan.start) == 6 and plan.stop == () and plan.unplaceable == ()
    again = place(cat, nodes, apply(plan, []), {"a": 4, "b": 2})
    assert again.start == () and again.stop == () and again.unplaceable == ()
    plan = place(cat, nodes, [], {"a": 5, "b": 2})
    assert len(plan.start) == 6 and plan.stop == () and len(plan.unplaceable) == 1
    again = place(cat, nodes, apply(plan, []), {"a": 5, "b": 2})
    assert again.start == () and again.stop == () and again.unplaceable == plan.unplaceable


@pytest.mark.parametrize("wanted, message", [
    ({"nope": 1, "a": 1}, "wanted names models the catalog does not have: nope"),
    ({"a": -1}, "wanted replica counts must be 0 or more: a=-1"),
])
def test_bad_wanted_is_a_clear_error(wanted, message):
    with pytest.raises(ValueError) as err:
        place(catalog(model("a")), [node("x")], [], wanted)
    assert str(err.value) == message


def test_duplicate_ids_or_nodes_are_a_clear_error():
    cat = catalog(model("a"))
    with pytest.raises(ValueError, match="replica 'r1' appears twice"):
        place(cat, [node("x")], [replica("r1", "a", "x"), replica("r1", "a", "x", gpus=(1,))], {})
    with pytest.raises(ValueError, match="node 'x' appears twice"):
        place(cat, [node("x"), node("x")], [], {})


def test_plan_is_plain_tuples_of_the_model_types():
    plan = place(catalog(model("a", profile("p1", gpus=1))), [node("x")], [replica("r0", "gone", "x", gpus=(3,))], {})
    assert plan.start == (Assignment("a", "p1", "x", (0,)),)
    assert plan.stop == (Stop("r0", MODEL_LEFT),) and plan.keep == () and plan.unplaceable == ()


def _fields(r: Running) -> dict:
    return {f: getattr(r, f) for f in Running.__slots__}


def test_ready_and_failed_at_once_counts_as_not_ready():
    cat = catalog(model("a"))
    running = [replica("r1", "a", "x", gpus=(0,), ready=True, failed=True),
               replica("r2", "a", "x", gpus=(1,), current=False, ready=True)]
    # The only current replica is not serving: the stale one stays.
    assert place(cat, [node("x")], running, {"a": 1}).stop == ()
    # Scaling down takes the failed one even though it is the older.
    running = [replica("r0", "a", "x", gpus=(0,), ready=True, failed=True), replica("r1", "a", "x", gpus=(1,), ready=True)]
    assert stops(place(cat, [node("x")], running, {"a": 1})) == [("r0", SCALED_DOWN)]


def test_the_design_example_catalog_places_as_an_operator_expects():
    from llmgwctl.catalog import load_text
    cat = load_text("""
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: qwen2.5-7b-instruct
    source: Qwen/Qwen2.5-7B-Instruct
    replicas: {min: 1, max: 4}
    profiles:
      - {name: h100, engine: vllm, pool: h100, gpus: 1, priority: 10}
      - {name: cpu-fallback, engine: llamacpp, gpus: 0, priority: 1}
""")
    nodes = [node("gpu-1", pools=("h100",), engines=("vllm",)), node("cpu-1", gpus=0, pools=("cpu",), engines=("llamacpp",))]
    plan = place(cat, nodes, [], {"qwen2.5-7b-instruct": 2})
    assert starts(plan) == [("qwen2.5-7b-instruct", "h100", "gpu-1", (0,)), ("qwen2.5-7b-instruct", "h100", "gpu-1", (1,))]
    # With the h100 node gone, the fallback takes over on the CPU node.
    plan = place(cat, nodes[1:], [], {})
    assert starts(plan) == [("qwen2.5-7b-instruct", "cpu-fallback", "cpu-1", ())]
