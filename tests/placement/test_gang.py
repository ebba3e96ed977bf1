"""Gang placement: a replica spanning nodes placed all or nothing, counted as one replica, stopped by its head's id;
and over random small fleets, every group on distinct qualifying nodes, no GPU twice, and the passes settle."""
from collections import Counter
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgwctl.catalog import Profile
from llmgwctl.placement import MODEL_LEFT, SCALED_DOWN, Running, Stop, place

from .helpers import apply, catalog, model, node, profile, replica


def gang(nodes: int = 2, gpus: int = 8, name: str = "gang", priority: int = 20, pool: str = "h100") -> Profile:
    return Profile(name, "vllm", pool=pool, gpus=gpus, priority=priority, nodes=nodes)


def members(gid: str, model: str, where, gpus=tuple(range(8)), profile: str = "gang", **flags) -> list[Running]:
    """One group's members: the head (its id is the group's) on where[0], rank i on where[i]."""
    return [Running(gid if rank == 0 else f"{gid}-r{rank}", model, profile, name, tuple(gpus), group=gid, rank=rank,
                    **flags) for rank, name in enumerate(where)]


def test_a_two_node_model_on_four_nodes_gets_two_distinct_nodes_best_fit_first():
    cat = catalog(model("big", gang(gpus=4), lo=1, hi=1), model("other", profile("p", gpus=4), lo=1, hi=1))
    # b has 4 free GPUs (the best fit), a and c 8, d 2 (too few).
    running = [replica("o1", "other", "b", gpus=(0, 1, 2, 3), profile="p", ready=True),
               replica("o2", "other", "d", gpus=(0, 1, 2, 3, 4, 5), profile="p", ready=True)]
    nodes = [node("a"), node("b"), node("c"), node("d")]
    plan = place(cat, nodes, running, {"other": 2})
    (start,) = plan.start
    assert (start.model, start.node, start.gpu_indices) == ("big", "b", (4, 5, 6, 7))
    assert start.members == (("a", (0, 1, 2, 3)),)
    assert plan.stop == () and plan.unplaceable == ()


def test_too_few_nodes_take_nothing_and_say_why():
    # Three nodes needed: a and b are free, c is busy, d is draining.
    cat = catalog(model("big", gang(nodes=3), lo=1, hi=1), model("small", profile("p", gpus=8), lo=2, hi=2))
    running = [replica("c1", "other", "c", gpus=(0,), profile="p", ready=True)]
    nodes = [node("a"), node("b"), node("c"), node("d", schedulable=False)]
    plan = place(cat, nodes, running, {})
    # Nothing of the group was taken: the model placed after it still gets both free nodes.
    assert sorted((a.model, a.node) for a in plan.start) == [("small", "a"), ("small", "b")]
    (why,) = plan.unplaceable
    assert (why.model, why.permanent) == ("big", False)
    assert why.reason == ("profile gang (vllm, 8 GPUs, pool h100): spans 3 nodes with 8 GPUs each: pool h100 has "
                          "0 nodes with 8 free GPUs (3 more are busy, 1 is unschedulable), needs 3; GPUs held by "
                          "small (priority 0, 16 GPUs), other (not in the catalog, 1 GPU)")
    # Without the other model, the same fleet has 2 of the 3 nodes free.
    alone = place(catalog(model("big", gang(nodes=3), lo=1, hi=1)), nodes, running, {})
    assert alone.start == ()
    assert "has 2 nodes with 8 free GPUs (1 more is busy, 1 is unschedulable), needs 3" in alone.unplaceable[0].reason


def test_a_pool_with_fewer_nodes_than_the_group_is_permanent():
    cat = catalog(model("big", gang(nodes=4), lo=1, hi=1))
    nodes = [node("a"), node("b"), node("c", gpus=4), node("d", engines=("llamacpp",)), node("e", pools=("a100",))]
    (why,) = place(cat, nodes, [], {}).unplaceable
    assert why.permanent
    assert why.reason.endswith("spans 4 nodes with 8 GPUs each: pool h100 has 2 nodes that can run vllm with 8 GPUs, "
                               "so it can never be placed; add 2 such nodes or lower the profile's nodes")
    # Not even one member could ever land: the one-node reason, under the group's.
    (why,) = place(catalog(model("big", gang(pool="b200"), lo=1, hi=1)), nodes, [], {}).unplaceable
    assert why.permanent and "spans 2 nodes with 8 GPUs each: no node has pool b200" in why.reason


def test_a_group_that_cannot_fit_leaves_the_rest_of_the_plan_as_it_was():
    others = [model(f"m{i}", profile("p", gpus=g), lo=1, hi=3) for i, g in enumerate((1, 2, 4, 8, 2, 1))]
    nodes = [node(f"n{i}", schedulable=i != 3) for i in range(6)]
    running = [replica(f"r{i}", "m0", f"n{i}", gpus=(0,), profile="p", ready=True) for i in range(0, 6, 2)]
    wanted = {"m0": 3, "m1": 3, "m2": 2, "m3": 3, "m4": 1, "m5": 2}
    without = place(catalog(*others), nodes, running, wanted)
    # A group of 4 nodes x 8 GPUs: the fleet has two whole nodes free, not four.
    with_gang = place(catalog(model("big", gang(nodes=4), lo=1, hi=1), *others), nodes, running, wanted)
    assert with_gang.start == without.start and with_gang.stop == without.stop
    assert [u.model for u in with_gang.unplaceable] == ["big"] + [u.model for u in without.unplaceable]


def test_a_model_whose_best_profile_spans_nodes_falls_back_to_one_node():
    cat = catalog(model("big", gang(), profile("one", gpus=8, priority=5), lo=2, hi=2))
    nodes = [node("a"), node("b"), node("c")]
    plan = place(cat, nodes, [], {})
    # The first group takes a and b; the second cannot find two nodes, so the fallback takes c.
    assert [(a.profile, a.node, a.members) for a in plan.start] == [
        ("gang", "a", (("b", tuple(range(8))),)), ("one", "c", ())]


def test_a_group_is_one_replica_of_its_model():
    cat = catalog(model("big", gang(), lo=1, hi=2))
    running = members("g1", "big", ("a", "b"), ready=True)
    plan = place(cat, [node("a"), node("b"), node("c"), node("d")], running, {"big": 1})
    assert plan.start == () and plan.stop == () and plan.unplaceable == ()
    assert plan.keep == ("g1", "g1-r1")
    # Wanting two: one more group, on the two nodes not running the model (spread).
    (start,) = place(cat, [node("a"), node("b"), node("c"), node("d")], running, {"big": 2}).start
    assert (start.node, [m for m, _ in start.members]) == ("c", ["d"])


def test_a_group_not_whole_or_a_member_failed_is_not_ready_and_not_placed_twice():
    cat = catalog(model("big", gang(nodes=3), lo=1, hi=1), model("fb", gang(), profile("one", gpus=1, priority=5),
                                                                   lo=1, hi=1))
    nodes = [node(n) for n in "abcdefg"]
    # big's rank 2 is missing: the reconciler's to stop; placement counts the group, starting, and does not crash.
    half = members("g1", "big", ("a", "b", "c"), ready=True)[:2]
    plan = place(cat, nodes, half, {"fb": 0})
    assert plan.start == () and plan.stop == () and plan.keep == ("g1", "g1-r1")
    # A headless group (only rank 1 reports) stands under its group id too.
    headless = members("g2", "big", ("a", "b", "c"), ready=True)[1:]
    assert place(cat, nodes, headless, {"fb": 0}).start == ()
    # Not ready as a group, so rule 8 does not move fb's fallback back while its group starts... and a failed
    # worker makes the group failed (not serving): wanting none, it is the one stopped first.
    fb = [*members("g3", "fb", ("d", "e"), ready=True), *members("g4", "fb", ("f", "g"), ready=True)]
    fb[3] = replace(fb[3], failed=True)       # g4's worker
    plan = place(cat, nodes, [*half, *fb], {"big": 1, "fb": 1})
    assert plan.stop == (Stop("g4", SCALED_DOWN),)
    assert plan.keep == ("g1", "g1-r1", "g3", "g3-r1")


def test_a_group_with_a_lost_member_is_lost_and_replaced_elsewhere():
    cat = catalog(model("big", gang(), lo=1, hi=1))
    running = members("g1", "big", ("a", "b"), ready=True)
    running[1] = replace(running[1], lost=True)
    (start,) = place(cat, [node(n) for n in "abcd"], running, {}).start
    # a still holds the head's GPUs and b the lost worker's: the new group lands on c and d.
    assert (start.node, start.members) == ("c", (("d", tuple(range(8))),))
    # A member on a node the inventory no longer has: the same.
    gone = members("g1", "big", ("a", "x"), ready=True)
    assert place(cat, [node(n) for n in "abcd"], gone, {}).start[0].node == "b"


def test_a_surplus_group_is_stopped_once_by_its_heads_id():
    cat = catalog(model("big", gang(), lo=1, hi=2))
    running = [*members("g1", "big", ("a", "b"), ready=True), *members("g2", "big", ("c", "d"), ready=True)]
    plan = place(cat, [node(n) for n in "abcd"], running, {"big": 1})
    assert plan.stop == (Stop("g2", SCALED_DOWN),)
    assert plan.keep == ("g1", "g1-r1") and plan.start == ()


def test_an_orphan_group_is_one_stop():
    cat = catalog(model("small", profile("p"), lo=0, hi=1))
    running = [*members("g1", "gone", ("a", "b"), ready=True),
               *members("g2", "small", ("c", "d"), profile="old", ready=True)]
    plan = place(cat, [node(n) for n in "abcd"], running, {"small": 0})
    assert plan.stop == (Stop("g1", MODEL_LEFT), Stop("g2", "profile old left model small"))
    assert plan.keep == () and plan.start == ()
    # A group of a left model whose head no longer reports: still one stop, by the group's id.
    headless = members("g3", "gone", ("a", "b", "c"))[1:]
    assert place(cat, [node(n) for n in "abcd"], headless, {"small": 0}).stop == (Stop("g3", MODEL_LEFT),)


def test_a_stale_group_is_replaced_surge_first_and_stopped_by_its_id():
    cat = catalog(model("big", gang(), lo=1, hi=1))
    nodes = [node(n) for n in "abcd"]
    stale = members("g1", "big", ("a", "b"), ready=True, current=False)
    (start,) = place(cat, nodes, stale, {}).start
    assert (start.node, start.members) == ("c", (("d", tuple(range(8))),))
    new = members("g2", "big", ("c", "d"), ready=True)
    assert place(cat, nodes, [*stale, *new], {}).stop == (Stop("g1", "replaced: profile changed"),)
    # One member still on the old spec makes the group stale.
    mixed = [new[0], replace(new[1], current=False)]
    assert place(cat, nodes, mixed, {}).start != ()


def test_a_lower_priority_group_is_a_victim_and_every_members_room_comes_free():
    low = replace(model("low", gang(), lo=1, hi=1), priority=1)
    # high's pool is only on b, where the group's worker is: the victim is the group, stopped by its head's id.
    high = replace(model("high", profile("p", gpus=8, pool="b-only"), lo=1, hi=1), priority=5)
    cat = catalog(low, high)
    nodes = [node("a"), node("b", pools=("h100", "b-only"))]
    running = members("g1", "low", ("a", "b"), ready=True)
    plan = place(cat, nodes, running, {})
    (stop,) = plan.stop
    assert (stop.replica_id, stop.preempted_by) == ("g1", "high")
    assert plan.keep == () and plan.start == ()
    (why,) = plan.unplaceable
    assert why.reason.startswith("preempting low (priority 1, g1) on b (it starts once they are gone)")
    # While the group drains (both members leaving), nothing more is stopped and the group is not replaced.
    leaving = [replace(r, leaving=True) for r in running]
    again = place(cat, nodes, leaving, {})
    assert again.stop == () and again.start == ()
    (waits,) = [u for u in again.unplaceable if u.model == "high"]
    assert waits.reason.startswith("waiting for low (priority 1, g1) to leave b")
    # Only the head leaving is the group leaving too: its worker's room on b is coming free.
    head_only = [replace(running[0], leaving=True), running[1]]
    assert place(cat, nodes, head_only, {}).stop == ()


def test_a_group_short_of_its_minimum_preempts_on_as_many_nodes_as_it_spans():
    low = replace(model("low", profile("p", gpus=4), lo=0, hi=4), priority=1)
    high = replace(model("high", gang(nodes=3), lo=1, hi=1), priority=5)
    # a is free; b and c each run two low replicas of 4 GPUs; d runs one of them and a priority-9 one.
    running = [replica("l1", "low", "b", gpus=(0, 1, 2, 3), profile="p", ready=True),
               replica("l2", "low", "b", gpus=(4, 5, 6, 7), profile="p", ready=True),
               replica("l3", "low", "c", gpus=(0, 1, 2, 3), profile="p", ready=True),
               replica("l4", "low", "c", gpus=(4, 5, 6, 7), profile="p", ready=True),
               replica("l5", "low", "d", gpus=(0, 1, 2, 3), profile="p", ready=True),
               replica("v1", "vip", "d", gpus=(4, 5, 6, 7), profile="p", ready=True)]
    nodes = [node(n) for n in "abcd"]
    cat = catalog(low, high, replace(model("vip", profile("p", gpus=4), lo=1, hi=1), priority=9))
    plan = place(cat, nodes, running, {"low": 5})
    # a is free now; b and c are freed (d cannot be: vip outranks high); both of b's and c's go.
    assert sorted(s.replica_id for s in plan.stop) == ["l1", "l2", "l3", "l4"]
    assert {s.preempted_by for s in plan.stop} == {"high"} and plan.start == ()
    (why,) = [u for u in plan.unplaceable if u.model == "high"]
    # Victim order (newest first) reaches c before b.
    assert why.reason.startswith("preempting low (priority 1, l4, l3) on c; preempting low (priority 1, l2, l1) on b "
                                 "(it starts once they are gone)")
    # While they drain, nothing more is stopped; once gone, the group lands on a, b and c.
    leaving = [replace(r, leaving=r.replica_id.startswith("l") and r.replica_id != "l5") for r in running]
    assert place(cat, nodes, leaving, {"low": 5}).stop == ()
    (start,) = place(cat, nodes, [running[4], running[5]], {"low": 1}).start
    assert (start.model, start.node, [n for n, _ in start.members]) == ("high", "a", ["b", "c"])


def test_a_group_that_cannot_make_room_on_enough_nodes_stops_nobody():
    low = replace(model("low", profile("p", gpus=8), lo=0, hi=4), priority=1)
    high = replace(model("high", gang(nodes=3), lo=1, hi=1), priority=5)
    vip = replace(model("vip", profile("p", gpus=8), lo=1, hi=2), priority=9)
    running = [replica("l1", "low", "a", gpus=tuple(range(8)), profile="p", ready=True),
               replica("v1", "vip", "b", gpus=tuple(range(8)), profile="p", ready=True),
               replica("v2", "vip", "c", gpus=tuple(range(8)), profile="p", ready=True)]
    plan = place(catalog(low, high, vip), [node(n) for n in "abcd"], running, {"low": 1, "vip": 2})
    # d is free and a could be freed: two of the three nodes, so l1 is not stopped for nothing.
    assert plan.stop == () and plan.start == ()


def test_the_free_node_a_preempting_group_counts_on_is_not_taken_by_a_surge_in_the_same_pass():
    # Found by the property below: fill runs a group on a fallback (n0 and the draining n1), so rule 8 surges
    # it back to "one". m0's group counts on n0's free GPU and preempts f4 on n2; when the surge took n0's GPU
    # in the same pass, m0 preempted the surge next pass, the next surge took n2's freed GPU, and so on for ever.
    m0 = replace(model("m0", gang(gpus=1), lo=1, hi=1), priority=1)
    fill = model("fill", profile("one", gpus=1), gang(gpus=1, priority=5), lo=0, hi=8)
    cat = catalog(m0, fill)
    nodes = [node("n0", gpus=2), node("n1", gpus=1, schedulable=False), node("n2", gpus=3)]
    running = [*members("fg", "fill", ("n0", "n1"), gpus=(0,), ready=True),
               *(replica(f"f{g + 2}", "fill", "n2", gpus=(g,), profile="one", ready=True) for g in range(3))]
    plan = place(cat, nodes, running, {"fill": 4})
    assert [(s.replica_id, s.preempted_by) for s in plan.stop] == [("f4", "m0")] and plan.start == ()
    (start,) = place(cat, nodes, [r for r in running if r.replica_id != "f4"], {"fill": 4}).start
    assert (start.model, start.node, start.members) == ("m0", "n0", (("n2", (2,)),))


def test_a_one_node_preemptor_keeps_the_free_gpu_it_counts_on_from_a_surge_too():
    # The same chase with m0's one-node fallback preempting f4 and counting on n3's free GPU 3.
    m0 = replace(model("m0", gang(gpus=0, name="g", priority=0), profile("one", gpus=2, priority=0), lo=1, hi=1),
                 priority=1)
    fill = model("fill", profile("one", gpus=1), gang(gpus=1, priority=5), lo=0, hi=8)
    cat = catalog(m0, fill)
    nodes = [node("n0", gpus=1, schedulable=False), node("n1", gpus=1, schedulable=False), node("n3", gpus=4)]
    running = [*members("fg", "fill", ("n0", "n1"), gpus=(0,), ready=True),
               *(replica(f"f{g + 2}", "fill", "n3", gpus=(g,), profile="one", ready=True) for g in range(3))]
    plan = place(cat, nodes, running, {"fill": 4})
    assert [s.replica_id for s in plan.stop] == ["f4"] and plan.start == ()
    (start,) = place(cat, nodes, [r for r in running if r.replica_id != "f4"], {"fill": 4}).start
    assert (start.model, start.node, start.gpu_indices) == ("m0", "n3", (2, 3))


def test_the_same_input_gives_the_same_plan_whatever_the_order_of_the_nodes():
    cat = catalog(model("big", gang(nodes=3, gpus=2), lo=3, hi=3), model("two", gang(gpus=4), lo=2, hi=2),
                  model("one", profile("p", gpus=2), lo=4, hi=4))
    nodes = [node(f"n{i}", gpus=4 + 2 * (i % 3)) for i in range(9)]
    running = [replica("r1", "one", "n4", gpus=(0, 1), profile="p", ready=True)]
    plans = [place(cat, order, running, {}) for order in (nodes, nodes[::-1], nodes[3:] + nodes[:3])]
    assert plans[0] == plans[1] == plans[2]
    # Preempting too: a priority-5 group of 3 nodes on a fleet full of priority-0 replicas but for two nodes.
    low = replace(model("low", profile("p", gpus=4), lo=0, hi=20), priority=0)
    high = replace(model("high", gang(nodes=3, gpus=4), lo=1, hi=1), priority=5)
    fleet = [node(f"n{i}") for i in range(6)]
    full = [replica(f"l{i}{h}", "low", f"n{i}", gpus=tuple(range(4 * h, 4 * h + 4)), profile="p", ready=True)
            for i in range(2, 6) for h in (0, 1)]
    pre = [place(catalog(low, high), order, full, {"low": 8}) for order in (fleet, fleet[::-1])]
    assert pre[0] == pre[1] and [s.replica_id for s in pre[0].stop] == ["l51"]     # n0, n1 free; half of n5
    assert sum(1 for a in plans[0].start if a.members) == 5
    for a in plans[0].start:
        assert len({a.node, *(m for m, _ in a.members)}) == 1 + len(a.members)    # distinct nodes


@st.composite
def gang_situations(draw):
    """Up to 6 nodes, models mixing groups of 2-3 nodes with one-node profiles, some groups already running."""
    nodes = [node(f"n{i}", gpus=draw(st.integers(0, 4)), pools=draw(st.sampled_from((("h100",), ("h100", "x")))),
                  schedulable=draw(st.integers(0, 5)) > 0) for i in range(draw(st.integers(0, 6)))]
    models = []
    for m in range(draw(st.integers(1, 3))):
        profiles = [gang(nodes=draw(st.integers(2, 3)), gpus=draw(st.integers(0, 3)), name="g",
                         priority=draw(st.integers(0, 3)), pool=draw(st.sampled_from(("h100", "x"))))]
        if draw(st.booleans()):
            profiles.append(profile("one", gpus=draw(st.integers(0, 2)), priority=draw(st.integers(0, 3))))
        lo = draw(st.integers(0, 2))
        models.append(replace(model(f"m{m}", *profiles, lo=lo, hi=lo + draw(st.integers(0, 1))),
                              priority=draw(st.sampled_from((1, 1, 5)))))
    # Priority-0 fillers on some GPUs (groups among them), for the models above to preempt.
    fill = model("fill", profile("one", gpus=1), gang(gpus=1, priority=5), lo=0, hi=8)
    running = []
    grouped = len(nodes) >= 2 and bool(nodes[0].gpus and nodes[1].gpus) and draw(st.booleans())
    if grouped:                                 # a filler group on GPU 0 of n0 and n1
        running += members("fg", "fill", ("n0", "n1"), gpus=(0,), ready=True)
    for i, n in enumerate(nodes):
        rest = n.gpus[1:] if grouped and i < 2 else n.gpus
        for g in rest[:draw(st.integers(0, len(rest)))]:
            running.append(replica(f"f{len(running)}", "fill", n.name, gpus=(g,), profile="one", ready=True))
    return catalog(*models, fill), nodes, running


def check_groups(cat, nodes, running, plan):
    by_name = {n.name: n for n in nodes}
    profiles = {(m.name, p.name): p for m in cat.models for p in m.profiles}
    for a in plan.start:
        p = profiles[(a.model, a.profile)]
        where = [(a.node, a.gpu_indices), *a.members]
        assert len(where) == p.nodes and len({n for n, _ in where}) == p.nodes       # all of it, distinct nodes
        for name, gpus in where:
            assert by_name[name].schedulable and p.pool in by_name[name].pools and len(gpus) == p.gpus
    after = apply(plan, running, cat)
    held = Counter((r.node, g) for r in after for g in r.gpu_indices)
    assert all(n == 1 for n in held.values()), held                                  # no GPU twice
    ids = {r.replica_id for r in running}
    groups = {r.group for r in running if r.group is not None}
    stopped = [s.replica_id for s in plan.stop]
    assert len(stopped) == len(set(stopped)) and set(stopped) <= ids | groups
    assert not any(r.rank and r.replica_id in stopped for r in running)                # never a worker alone
    gone = {r.replica_id for r in running if r.replica_id in stopped or r.group in stopped}
    assert set(plan.keep) == ids - gone


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gang_situations())
def test_groups_fill_settle_and_count_once(situation):
    cat, nodes, running = situation
    wanted = {"fill": min(8, len({r.group or r.replica_id for r in running}))}
    plan = place(cat, nodes, running, wanted)
    for _ in range(8):
        check_groups(cat, nodes, running, plan)
        if not plan.start and not plan.stop:
            break
        running = [replace(r, ready=True) for r in apply(plan, running, cat)]
        plan = place(cat, nodes, running, wanted)
    assert plan.start == () and plan.stop == ()
    # Each model runs its minimum if it fits, counting a group once.
    heads = Counter(r.model for r in running if r.rank == 0)
    short = Counter(u.model for u in plan.unplaceable)
    for m in cat.models:
        if m.name != "fill":
            assert heads[m.name] + short[m.name] == m.replicas.min
