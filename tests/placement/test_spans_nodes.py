"""A profile spanning nodes is placed as a group on distinct nodes, never on one; its one-node fallback works as before."""
from dataclasses import replace

from llmgwctl.catalog import Profile
from llmgwctl.placement import Unplaceable, place

from .helpers import catalog, model, node, profile, replica


def group(gpus: int = 4, priority: int = 20) -> Profile:
    return Profile("two-nodes", "vllm", pool="h100", gpus=gpus, priority=priority, nodes=2)


def test_a_profile_spanning_nodes_lands_on_two_nodes_never_on_one():
    cat = catalog(model("big", group(), lo=1, hi=1))
    (start,) = place(cat, [node("x"), node("y")], [], {}).start
    assert (start.node, start.gpu_indices, start.members) == ("x", (0, 1, 2, 3), (("y", (0, 1, 2, 3)),))
    plan = place(cat, [node("x")], [], {})
    assert plan.start == ()
    (why,) = plan.unplaceable
    assert why == Unplaceable("big", "profile two-nodes (vllm, 4 GPUs, pool h100): spans 2 nodes with 4 GPUs each: "
                                     "pool h100 has 1 node that can run vllm with 4 GPUs, so it can never be placed; "
                                     "add 1 such node or lower the profile's nodes", permanent=True)


def test_its_one_node_profile_is_the_fallback_and_the_group_is_a_move_back_once_it_fits():
    cat = catalog(model("big", group(), profile("one", gpus=4, priority=10), lo=2, hi=2))
    plan = place(cat, [node("x")], [], {})
    assert sorted((a.profile, a.node, a.members) for a in plan.start) == [("one", "x", ()), ("one", "x", ())]
    # Everything serving on the fallback, and a second node came: rule 8
    # moves one replica back to the better profile, the group, on both nodes.
    running = [replica("r1", "big", "x", gpus=(0, 1, 2, 3), profile="one", ready=True),
               replica("r2", "big", "y", gpus=(0, 1, 2, 3), profile="one", ready=True)]
    (start,) = place(cat, [node("x"), node("y")], running, {}).start
    assert (start.profile, start.replaces, start.node, start.members) == \
        ("two-nodes", "r2", "x", (("y", (4, 5, 6, 7)),))


def test_a_short_higher_priority_group_preempts_for_the_node_it_lacks():
    low = replace(model("low", profile("p", gpus=8, priority=10), lo=1, hi=1), priority=1)
    high = replace(model("high", group(gpus=8), lo=1, hi=1), priority=5)
    cat = catalog(low, high)
    running = [replica("r1", "low", "x", gpus=tuple(range(8)), profile="p", ready=True)]
    plan = place(cat, [node("x"), node("y")], running, {})
    assert [(s.replica_id, s.preempted_by) for s in plan.stop] == [("r1", "high")] and plan.start == ()
    (why,) = plan.unplaceable
    assert why.model == "high" and not why.permanent
    assert why.reason == ("preempting low (priority 1, r1) on x (it starts once they are gone); profile two-nodes "
                          "(vllm, 8 GPUs, pool h100): spans 2 nodes with 8 GPUs each: pool h100 has 1 node with 8 "
                          "free GPUs (1 more is busy), needs 2; GPUs held by low (priority 1, 8 GPUs)")
