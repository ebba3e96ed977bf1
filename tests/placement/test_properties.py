"""Properties of place() over random small fleets, catalogs and replica sets.

(1) no GPU is ever given twice to replicas that take it whole, a whole one
    never shares, and the memory declared on a shared GPU never exceeds it;
(2) every start lands on a node that qualifies for its profile;
(3) applying a plan with no stops and placing again gives no starts and no
    stops; a plan with stops (whose freed room the next pass may use) settles
    within a bounded number of passes;
(4) a replica is either kept or stopped, never both, never neither;
and the counts add up: current replicas after the plan plus unplaceable ones
equal what was wanted, for every model that did not have a surplus (less
the current replicas preemption stopped, plus the surge starts that move a
model back to its best profile).
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
        # Memory known on most GPUs (24 GiB, some of it held outside llmgw), unknown on a few.
        memory = {g: (24 * 1024, draw(st.sampled_from((24, 24, 20, 8))) * 1024) for g in range(gpus)
                  if draw(st.integers(0, 5))}
        nodes.append(NodeView(
            f"n{i}", frozenset(draw(st.sets(st.sampled_from(POOLS[:2]), max_size=2))), tuple(range(gpus)),
            frozenset(draw(st.sets(st.sampled_from(ENGINES), min_size=1))), draw(st.booleans() | st.just(True)),
            memory=memory))
    return nodes


@st.composite
def catalogs(draw):
    models = []
    for m in range(draw(st.integers(1, 3))):
        profiles = []
        for i in range(draw(st.integers(1, 3))):
            gpus = draw(st.integers(0, 3))
            memory = draw(st.sampled_from((None, None, 8 * 1024, 16 * 1024, 30 * 1024))) if gpus else None
            profiles.append(Profile(f"p{i}", draw(st.sampled_from(ENGINES)),
                                    pool=draw(st.none() | st.sampled_from(POOLS)), gpus=gpus,
                                    priority=draw(st.integers(0, 3)), gpu_memory_mib=memory))
        lo = draw(st.integers(0, 2))
        models.append(Model(f"m{m}", tuple(profiles), replicas=Replicas(lo, lo + draw(st.integers(0, 2))),
                            priority=draw(st.sampled_from((0, 0, 5)))))
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
                               ready=draw(st.booleans()), failed=draw(st.booleans()), lost=draw(st.booleans()),
                               leaving=draw(st.integers(0, 5)) == 0))
    wanted = {m.name: draw(st.integers(m.replicas.min, m.replicas.max)) for m in cat.models if draw(st.booleans())}
    return cat, nodes, running, wanted


def check_one(cat, nodes, running, wanted):
    plan = place(cat, nodes, running, wanted)
    by_name = {n.name: n for n in nodes}
    profiles = {(m.name, p.name): p for m in cat.models for p in m.profiles}

    # (1) no GPU twice to whole holders, and shared GPUs within their memory
    after_plan = apply(plan, running, cat)
    holders: dict = {}
    for r in after_plan:
        for g in r.gpu_indices:
            holders.setdefault((r.node, g), []).append(r.memory_mib)
    for (name, g), needs in holders.items():
        if len(needs) > 1:
            assert 0 not in needs, (name, g, needs)
    pending: Counter = Counter()      # memory not yet seen allocated: replicas not ready, and the starts
    for r in after_plan:
        if not (r.ready and not r.failed):
            pending.update({(r.node, g): r.memory_mib for g in r.gpu_indices})
    for a in plan.start:
        memory = profiles[(a.model, a.profile)].gpu_memory_mib
        for g in a.gpu_indices:
            needs = holders[(a.node, g)]
            if memory:
                total, free = by_name[a.node].memory[g]
                assert sum(needs) <= total and pending[(a.node, g)] <= free, (a, needs)
            else:
                assert needs == [0], (a, needs)

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
    def counted_toward_wanted(r):
        return (r.current and not r.lost and not r.leaving and r.node in by_name
                and (r.model, r.profile) in profiles)

    def counts(rs):
        return Counter(r.model for r in rs if counted_toward_wanted(r))
    counted, after = counts(running), counts(after_plan)
    short = Counter(u.model for u in plan.unplaceable)
    surge = Counter(a.model for a in plan.start if a.replaces)
    # Only victims that counted toward wanted take from it: a stale victim
    # (old profile) was never one of the current replicas, and its model's
    # replacement is placed (or reported unplaceable) as for any stale replica.
    by_id = {r.replica_id: r for r in running}
    preempted = Counter(by_id[s.replica_id].model for s in plan.stop
                        if s.preempted_by and counted_toward_wanted(by_id[s.replica_id]))
    for m in cat.models:
        want = wanted.get(m.name, m.replicas.min)
        if counted[m.name] <= want:
            assert after[m.name] + short[m.name] + preempted[m.name] == want + surge[m.name]
        else:
            # Surplus stops may wait for a better-ranked replica to be ready (a move back to the best profile).
            assert after[m.name] >= want and short[m.name] == 0
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
    # per model per pass, and a preemption may cascade down the priorities,
    # so 2 + stale + models passes are always enough.
    for _ in range(2 + stale + len(cat.models)):
        had_stops = bool(plan.stop)
        running = apply(plan, running, cat)
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


def test_stale_victims_of_preemption_found_by_hypothesis():
    # The two failures hypothesis shrank to: m1's only replica r0 is stale and holds n1's one
    # GPU; m2 (priority 5) preempts it. With m1 unable to start anywhere, r0 was also
    # stopped as "replaced: no room" (stopped twice); with m1's replacement on a GPU-less
    # profile, the property counted the stale victim against m1's wanted (off by one).
    def cat(m1_gpus):
        return Catalog([
            Model("m0", (Profile("p0", "vllm", gpus=0, priority=0),), replicas=Replicas(0, 0)),
            Model("m1", (Profile("p0", "vllm", gpus=m1_gpus, priority=0),)
                  + ((Profile("p1", "llamacpp", gpus=0, priority=0),) if m1_gpus else ()), replicas=Replicas(1, 1)),
            Model("m2", (Profile("p0", "vllm", gpus=1, priority=0), Profile("p1", "llamacpp", gpus=0, priority=0)),
                  replicas=Replicas(1, 1), priority=5)])
    nodes = [NodeView("n0", frozenset(), (), frozenset({"vllm"}), False),
             NodeView("n1", frozenset(), (0,), frozenset({"vllm"}), True)]
    running = [Running("r0", "m1", "p0", "n1", (0,), current=False)]
    twice = check_one(cat(1), nodes, running, {})
    assert [(s.replica_id, s.preempted_by) for s in twice.stop] == [("r0", "m2")]
    off_by_one = check_one(cat(0), nodes, running, {})
    assert [(a.model, a.node) for a in off_by_one.start] == [("m1", "n1")]
    assert [(s.replica_id, s.preempted_by) for s in off_by_one.stop] == [("r0", "m2")]
