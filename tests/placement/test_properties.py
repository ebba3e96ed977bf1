"""Properties of place() over random small fleets, catalogs and replica sets.

(1) no GPU is ever given twice, across existing replicas and new ones;
(2) every start lands on a node that qualifies for its profile;
(3) applying a plan with no stops and placing again gives no starts and no
    stops; a plan with stops (whose freed room the next pass may use) settles
    within a bounded number of passes;
(4) a replica is either kept or stopped, never both, never neither;
and the counts add up: current replicas after the plan plus unplaceable ones
equal what was wanted, for every model that did not have a surplus.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings, strategies as st

from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.placement import NodeView, Running, place

from .helpers import apply

POOLS = ("a", "b", "c")          # c is carried by no node sometimes: "no node in pool c"
ENGINES = ("vllm", "llamacpp")


@st.composite
def fleets(draw):
    nodes = []
    for i in range(draw(st.integers(0, 4))):
        gpus = draw(st.integers(0, 4))
        nodes.append(NodeView(
            f"n{i}", frozenset(draw(st.sets(st.sampled_from(POOLS[:2]), max_size=2))), tuple(range(gpus)),
            frozenset(draw(st.sets(st.sampled_from(ENGINES), min_size=1))), draw(st.booleans() | st.just(True))))
    return nodes


@st.composite
def catalogs(draw):
    models = []
    for m in range(draw(st.integers(1, 3))):
        profiles = tuple(
            Profile(f"p{i}", draw(st.sampled_from(ENGINES)), pool=draw(st.none() | st.sampled_from(POOLS)),
                    gpus=draw(st.integers(0, 3)), priority=draw(st.integers(0, 3)))
            for i in range(draw(st.integers(1, 3))))
        lo = draw(st.integers(0, 2))
        models.append(Model(f"m{m}", profiles, replicas=Replicas(lo, lo + draw(st.integers(0, 2)))))
    return Catalog(models)


@st.composite
def situations(draw):
    nodes, cat = draw(fleets()), draw(catalogs())
    free = {n.name: list(n.gpus) for n in nodes}
    running = []
    for i in range(draw(st.integers(0, 8))):
        # Some replicas on a node that has left the inventory, of a model or profile that left the catalog.
        where = draw(st.sampled_from(sorted(free) + ["ghost"]))
        # Mostly replicas of catalog models on their own profiles, so surplus
        # and stale replicas are common; now and then an orphan.
        model = draw(st.sampled_from(list(cat.models) * 4 + [None]))
        if model is None:
            model, profile = "gone", "p0"
        else:
            model, profile = model.name, draw(st.sampled_from([p.name for p in model.profiles] * 4 + ["old"]))
        count = draw(st.integers(0, 2))
        held = free.get(where, [])
        gpus, free[where] = tuple(held[:count]), held[count:]
        running.append(Running(f"r{i}", model, profile, where, gpus, current=draw(st.booleans()),
                               ready=draw(st.booleans()), failed=draw(st.booleans()), lost=draw(st.booleans())))
    wanted = {m.name: draw(st.integers(m.replicas.min, m.replicas.max)) for m in cat.models if draw(st.booleans())}
    return cat, nodes, running, wanted


def check_one(cat, nodes, running, wanted):
    plan = place(cat, nodes, running, wanted)
    by_name = {n.name: n for n in nodes}
    profiles = {(m.name, p.name): p for m in cat.models for p in m.profiles}

    # (1) no GPU twice
    held = Counter((r.node, g) for r in running for g in r.gpu_indices)
    held.update((a.node, g) for a in plan.start for g in a.gpu_indices)
    assert all(n == 1 for n in held.values()), held

    # (2) every start qualifies
    for a in plan.start:
        node, profile = by_name[a.node], profiles[(a.model, a.profile)]
        assert node.schedulable and profile.engine in node.engines
        assert profile.pool is None or profile.pool in node.pools
        assert len(a.gpu_indices) == profile.gpus and set(a.gpu_indices) <= set(node.gpus)

    # (4) kept xor stopped
    stopped = [s.replica_id for s in plan.stop]
    assert len(stopped) == len(set(stopped))
    assert not set(stopped) & set(plan.keep)
    assert set(stopped) | set(plan.keep) == {r.replica_id for r in running}

    # the counts add up
    counted = Counter(r.model for r in running if r.current and not r.lost and r.node in by_name
                      and (r.model, r.profile) in profiles)
    after = Counter(r.model for r in apply(plan, running) if r.current and not r.lost and r.node in by_name
                    and (r.model, r.profile) in profiles)
    short = Counter(u.model for u in plan.unplaceable)
    for m in cat.models:
        want = wanted.get(m.name, m.replicas.min)
        if counted[m.name] <= want:
            assert after[m.name] + short[m.name] == want
        else:
            assert after[m.name] == want and short[m.name] == 0
    return plan


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(situations())
def test_placement_properties(situation):
    cat, nodes, running, wanted = situation
    stale = sum(not r.current for r in running)
    plan = check_one(cat, nodes, running, wanted)
    # (3) Nothing becomes ready between passes, so the only thing that can
    # make a later pass differ is room freed by a stop. Each pass with stops is
    # followed by at most one more; stop-then-start stops one stale replica
    # per model per pass, so 2 + stale passes are always enough.
    for _ in range(2 + stale):
        had_stops = bool(plan.stop)
        running = apply(plan, running)
        plan = check_one(cat, nodes, running, wanted)
        if not had_stops:
            assert plan.start == () and plan.stop == ()
        if not plan.start and not plan.stop:
            break
    assert plan.start == () and plan.stop == ()


def test_same_input_same_plan():
    from .helpers import catalog, model, node, profile
    cat = catalog(model("a", profile(gpus=2)), model("b", profile("cpu", engine="llamacpp", pool=None, gpus=0)))
    nodes = [node(f"n{i}") for i in range(5)]
    assert place(cat, nodes, [], {"a": 4, "b": 3}) == place(cat, list(nodes), [], {"b": 3, "a": 4})
