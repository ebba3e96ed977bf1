"""A profile spanning nodes before gang placement exists: never placed on one node, and said so."""
from dataclasses import replace

from llmgwctl.catalog import Profile
from llmgwctl.placement import Unplaceable, place

from .helpers import catalog, model, node, profile, replica


def group(gpus: int = 4, priority: int = 20) -> Profile:
    return Profile("two-nodes", "vllm", pool="h100", gpus=gpus, priority=priority, nodes=2)


def test_a_profile_spanning_nodes_never_lands_on_one_node():
    cat = catalog(model("big", group(), lo=1, hi=1))
    plan = place(cat, [node("x"), node("y")], [], {})
    assert plan.start == ()
    (why,) = plan.unplaceable
    assert why == Unplaceable("big", "profile two-nodes (vllm, 4 GPUs, pool h100): spans 2 nodes, and placing one "
                                     "replica across several nodes is not built yet; give the model a profile with "
                                     "nodes: 1 to run it meanwhile", permanent=True)


def test_its_one_node_profile_is_placed_as_before_and_the_group_is_not_a_move_back():
    cat = catalog(model("big", group(), profile("one", gpus=4, priority=10), lo=2, hi=2))
    plan = place(cat, [node("x"), node("y")], [], {})
    assert sorted((a.profile, a.node) for a in plan.start) == [("one", "x"), ("one", "y")]
    # Everything serving on the fallback: rule 8 would move it back to the
    # better profile, which is the group, and must not.
    running = [replica("r1", "big", "x", gpus=(0, 1, 2, 3), profile="one", ready=True),
               replica("r2", "big", "y", gpus=(0, 1, 2, 3), profile="one", ready=True)]
    assert place(cat, [node("x"), node("y")], running, {}).start == ()


def test_a_short_higher_priority_group_preempts_nothing():
    low = replace(model("low", profile("p", gpus=8, priority=10), lo=1, hi=1), priority=1)
    high = replace(model("high", group(gpus=8), lo=1, hi=1), priority=5)
    cat = catalog(low, high)
    running = [replica("r1", "low", "x", gpus=tuple(range(8)), profile="p", ready=True)]
    plan = place(cat, [node("x")], running, {})
    assert plan.stop == () and plan.start == ()
    assert [u.model for u in plan.unplaceable] == ["high"]
