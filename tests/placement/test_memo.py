"""place() with a Memo carried from call to call gives the plan it gives without one.

The memo keeps per-node and per-model pieces from the last call and reuses
them where that piece's input is the same. Each test here changes exactly one
input a piece is built from and leaves everything else identical (the same
objects, as the reconciler hands them), so a piece reused when it should not
be shows as a plan that missed the change.
"""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.placement import Memo, NodeView, Running, place

from .helpers import apply, catalog, model, node, profile, replica
from .test_properties import situations


def ready(r: Running) -> Running:
    return dataclasses.replace(r, ready=True)


def both(cat, nodes, running, wanted, memo, movable=None):
    """The plan with the memo, checked against the plan without one."""
    plan = place(cat, nodes, running, wanted, movable, memo=memo)
    assert plan == place(cat, nodes, running, wanted, movable)
    return plan


def test_one_nodes_replicas_changed_the_plan_follows():
    cat = catalog(model("m", lo=3))
    nodes = [node("a"), node("b"), node("c")]
    running = [ready(replica(f"r-{n.name}", "m", n.name)) for n in nodes]
    memo = Memo()
    assert both(cat, nodes, running, {}, memo).start == ()
    # b's replica is gone; every other input is the very object of the last call.
    without_b = [r for r in running if r.node != "b"]
    (start,) = both(cat, nodes, without_b, {}, memo).start
    assert (start.node, start.gpu_indices) == ("b", (0,))
    # And back: the same plan as the first call, not the one just made.
    assert both(cat, nodes, running, {}, memo).start == ()


def test_a_replica_moved_to_other_gpus_frees_the_ones_it_had():
    cat = catalog(model("m", lo=1), model("big", profile(gpus=7), lo=1))
    nodes = [node("a")]
    r = ready(replica("r1", "m", "a", gpus=(0,)))
    memo = Memo()
    (start,) = both(cat, nodes, [r], {}, memo).start
    assert start.gpu_indices == (1, 2, 3, 4, 5, 6, 7)
    moved = dataclasses.replace(r, gpu_indices=(7,))     # same id, node and model: only its GPUs differ
    (start,) = both(cat, nodes, [moved], {}, memo).start
    assert start.gpu_indices == (0, 1, 2, 3, 4, 5, 6)


def test_a_node_reporting_fewer_gpus_with_the_same_replicas():
    cat = catalog(model("m", lo=1), model("other", lo=1))
    running = [ready(replica("r1", "m", "a", gpus=(0,)))]
    memo = Memo()
    (start,) = both(cat, [node("a", gpus=2)], running, {}, memo).start
    assert (start.model, start.gpu_indices) == ("other", (1,))
    plan = both(cat, [node("a", gpus=1)], running, {}, memo)
    assert plan.start == () and [u.model for u in plan.unplaceable] == ["other"]


def test_a_replica_turning_ready_changes_the_memory_a_gpu_has_left():
    # 24 GiB reported free; r1 (not ready) declared 16 GiB it may not have allocated yet.
    gib = 1024
    cat = Catalog([Model("s", (Profile("p", "vllm", pool="h100", gpus=1, gpu_memory_mib=16 * gib),),
                         replicas=Replicas(2, 2))])
    nodes = [NodeView("a", frozenset({"h100"}), (0,), frozenset({"vllm"}), memory={0: (40 * gib, 24 * gib)})]
    starting = Running("r1", "s", "p", "a", (0,), memory_mib=16 * gib)
    memo = Memo()
    assert both(cat, nodes, [starting], {}, memo).start == ()       # 24 - 16 pending: no room for 16 more
    # Ready: its 16 GiB are in the reported free figure now, so 24 GiB are left for the second.
    (start,) = both(cat, nodes, [ready(starting)], {}, memo).start
    assert (start.node, start.gpu_indices) == ("a", (0,))


def test_the_starts_of_one_call_do_not_stay_in_the_memo():
    # A call's own starts take room in its Fleet; the pieces it keeps are of its input only.
    gib = 1024
    cat = Catalog([Model("s", (Profile("p", "vllm", pool="h100", gpus=1, gpu_memory_mib=8 * gib),),
                         replicas=Replicas(3, 3)),
                   Model("w", (Profile("p", "vllm", pool="h100", gpus=2),), replicas=Replicas(1, 1))])
    nodes = [NodeView("a", frozenset({"h100"}), (0, 1, 2), frozenset({"vllm"}),
                      memory={i: (24 * gib, 24 * gib) for i in range(3)})]
    running = [Running("r1", "s", "p", "a", (0,), memory_mib=8 * gib, ready=True)]
    memo = Memo()
    first = both(cat, nodes, running, {}, memo)
    assert len(first.start) == 3
    assert both(cat, nodes, running, {}, memo) == first


def test_a_whole_gpu_taken_by_one_call_is_free_in_the_next():
    gib = 1024
    cat = Catalog([Model("w", (Profile("p", "vllm", pool="h100", gpus=1),), replicas=Replicas(1, 2)),
                   Model("s", (Profile("p", "vllm", pool="h100", gpus=1, gpu_memory_mib=8 * gib),),
                         replicas=Replicas(1, 1))])
    nodes = [NodeView("a", frozenset({"h100"}), (0, 1, 2), frozenset({"vllm"}),
                      memory={i: (24 * gib, 24 * gib) for i in range(3)})]
    running = [Running("r1", "w", "p", "a", (0,), ready=True)]     # holds GPU 0 whole
    memo = Memo()
    w, s = both(cat, nodes, running, {"w": 2}, memo).start
    assert (w.model, w.gpu_indices, s.model, s.gpu_indices) == ("w", (1,), "s", (2,))
    # w wants one now: GPU 1 was only this call's, so s gets it (best fit, lowest index).
    (s,) = both(cat, nodes, running, {"w": 1}, memo).start
    assert (s.model, s.gpu_indices) == ("s", (1,))


def test_wanted_changed_with_the_same_replicas():
    cat = catalog(model("m", lo=1, hi=3))
    nodes = [node("a"), node("b")]
    running = [ready(replica("r1", "m", "a"))]
    memo = Memo()
    assert both(cat, nodes, running, {"m": 1}, memo).start == ()
    assert [a.node for a in both(cat, nodes, running, {"m": 2}, memo).start] == ["b"]


def test_a_catalog_swap_with_the_same_replicas():
    running = [ready(replica("r1", "m", "a"))]
    nodes = [node("a"), node("b")]
    memo = Memo()
    assert both(catalog(model("m", lo=1)), nodes, running, {}, memo).start == ()
    # A new Model (its minimum raised), everything else the same objects.
    assert [a.node for a in both(catalog(model("m", lo=2)), nodes, running, {}, memo).start] == ["b"]


def test_a_node_leaving_the_inventory_makes_its_replicas_lost():
    cat = catalog(model("m", lo=1))
    a, b = node("a"), node("b")
    running = [ready(replica("r1", "m", "a"))]
    memo = Memo()
    assert both(cat, [a, b], running, {}, memo).start == ()
    # a is gone from the inventory: r1 no longer counts and a replacement goes to b.
    assert [s.node for s in both(cat, [b], running, {}, memo).start] == ["b"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(situations(), situations(), st.data())
def test_a_memo_never_changes_a_plan(first, then, data):
    """Primed by an unrelated call (names overlap: n0.., m0.., r0..), then carried through passes with edits."""
    memo = Memo()
    both(*first, memo=memo)
    cat, nodes, running, wanted = then
    for _ in range(6):
        plan = both(cat, nodes, running, wanted, memo)
        running = apply(plan, running, cat)
        # One edit between passes, the rest of the input the same objects.
        edit = data.draw(st.sampled_from(("none", "flip", "wanted", "node")))
        if edit == "flip" and running:
            i = data.draw(st.integers(0, len(running) - 1))
            running = [*running[:i], dataclasses.replace(running[i], ready=not running[i].ready), *running[i + 1:]]
        elif edit == "wanted":
            m = data.draw(st.sampled_from(cat.models))
            wanted = {**wanted, m.name: data.draw(st.integers(m.replicas.min, m.replicas.max))}
        elif edit == "node" and nodes:
            i = data.draw(st.integers(0, len(nodes) - 1))
            nodes = [*nodes[:i], dataclasses.replace(nodes[i], gpus=nodes[i].gpus[:-1]), *nodes[i + 1:]]
