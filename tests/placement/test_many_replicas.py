"""Many replicas of one model placed in one pass land exactly where the placement rule says.

The rule (`Fleet.pick`): a node without a replica of the model beats one
with; then fewest of its replicas; then best-fit (fewest free GPUs, or least
memory budget, that still fit); then the name. The reference below applies
it the obvious way, every node scanned for every replica, so the indexed
placer must choose the same node, and the same GPUs, for each of hundreds of
replicas of one model -- the case where the held nodes pile up at the top of
the index (issue 19).
"""
from __future__ import annotations

from collections import defaultdict

from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.placement import place

from .helpers import memory_node, node, replica


def _round_robin(models, wanted, spread, pick):
    """(model, node, gpus) per start: one replica per model in turn, as place() goes round the models.

    `pick(model, spread)` takes the room for one replica of `model` and
    returns (node, gpus), or None when nothing fits it any more.
    """
    missing = {m.name: wanted[m.name] - sum(spread[m.name].values()) for m in models}
    out = []
    while any(missing.values()):
        for m in models:
            if not missing[m.name]:
                continue
            found = pick(m, spread[m.name])
            if found is None:
                missing[m.name] = 0
                continue
            best, chosen = found
            spread[m.name][best] += 1
            missing[m.name] -= 1
            out.append((m.name, best, tuple(chosen)))
    return out


def _spread(running, models):
    spread = {m.name: defaultdict(int) for m in models}
    for r in running:
        if r.model in spread:
            spread[r.model][r.node] += 1
    return spread


def whole_reference(nodes, running, wanted, models):
    """(model, node, gpus) per start, for whole-GPU profiles: fewest of the model's replicas, then best fit."""
    free = {n.name: [g for g in n.gpus if not any(r.node == n.name and g in r.gpu_indices for r in running)]
            for n in nodes}

    def pick(m, spread):
        p = m.profiles[0]
        fits = [n.name for n in nodes if n.schedulable and len(free[n.name]) >= p.gpus]
        if not fits:
            return None
        best = min(fits, key=lambda n: (spread[n], len(free[n]), n))
        room = free[best]
        chosen = next((room[i:i + p.gpus] for i in range(len(room) - p.gpus + 1)
                       if room[i + p.gpus - 1] - room[i] == p.gpus - 1), room[:p.gpus])
        free[best] = [g for g in room if g not in chosen]
        return best, chosen

    return _round_robin(models, wanted, _spread(running, models), pick)


def memory_reference(nodes, running, wanted, models):
    """(model, node, gpus) per start for one-profile memory models.

    The nodes report every GPU free (nothing has allocated yet), so a GPU's
    budget is its total less what the replicas on it declared.
    """
    budget = {n.name: {g: t for g, (t, _) in n.memory.items()} for n in nodes}
    for r in running:
        for g in r.gpu_indices:
            budget[r.node][g] -= r.memory_mib

    def pick(m, spread):
        p = m.profiles[0]
        kth = {n: sorted(b.values(), reverse=True)[p.gpus - 1] for n, b in budget.items()}
        fits = [n for n in budget if kth[n] >= p.gpu_memory_mib]
        if not fits:
            return None
        best = min(fits, key=lambda n: (spread[n], kth[n], n))
        room = sorted((b, i) for i, b in budget[best].items() if b >= p.gpu_memory_mib)
        chosen = sorted(i for _, i in room[:p.gpus])
        for i in chosen:
            budget[best][i] -= p.gpu_memory_mib
        return best, chosen

    return _round_robin(models, wanted, _spread(running, models), pick)


def starts(plan):
    return [(a.model, a.node, a.gpu_indices) for a in plan.start]


def test_hundreds_of_replicas_of_one_model_follow_the_rule_node_by_node():
    # 40 nodes of 8 GPUs, a few already part-full with another model and a few
    # with this model's replicas, so spread, best-fit and names all decide somewhere.
    nodes = [node(f"n{i:02d}", gpus=8) for i in range(40)]
    big = Model("big", (Profile("main", "vllm", pool="h100", gpus=1),), source="org/big", replicas=Replicas(0, 1000))
    other = Model("other", (Profile("main", "vllm", pool="h100", gpus=3),), source="org/other", replicas=Replicas(0, 10))
    running = [replica(f"o{i}", "other", f"n{i * 7:02d}", gpus=(0, 1, 2), profile="main") for i in range(5)]
    running += [replica(f"b{i}", "big", f"n{i * 3 + 1:02d}", gpus=(4,), profile="main") for i in range(6)]
    wanted = {"big": 250, "other": 5}
    plan = place(Catalog((big, other)), nodes, running, wanted)
    expected = whole_reference(nodes, running, wanted, [big])
    assert len(expected) == 244
    assert starts(plan) == expected
    # More than one per node: the later replicas double up, spread evenly.
    assert {n for _, n, _ in expected[-40:]} <= {n.name for n in nodes}


def test_two_models_with_many_replicas_each_interleave_as_the_rule_says():
    # Round-robin between two many-replica models: each pick of one model
    # follows a pick of the other. a already runs on n00-n09, the fullest
    # nodes: a's picks skip them, and b's must still find them first.
    nodes = [node(f"n{i:02d}", gpus=8) for i in range(30)]
    a = Model("a", (Profile("main", "vllm", pool="h100", gpus=1),), source="org/a", replicas=Replicas(0, 1000))
    b = Model("b", (Profile("main", "vllm", pool="h100", gpus=2),), source="org/b", replicas=Replicas(0, 1000))
    running = [replica(f"a{i}", "a", f"n{i:02d}", gpus=(0, 1, 2, 3, 4), profile="main") for i in range(10)]
    wanted = {"a": 100, "b": 40}
    plan = place(Catalog((a, b)), nodes, running, wanted)
    expected = whole_reference(nodes, running, wanted, [a, b])
    assert [n for m, n, _ in expected[:4]] == ["n10", "n00", "n11", "n01"]
    assert len(expected) == 130
    assert starts(plan) == expected


def test_hundreds_of_memory_replicas_follow_the_rule_node_by_node():
    # 4 GPUs of 80 GiB per node, 20 GiB per replica: 16 per node, shared GPUs packed first.
    nodes = [memory_node(f"m{i:02d}", gib=(80, 80, 80, 80)) for i in range(25)]
    for gpus, count in ((1, 300), (2, 150)):
        m = Model("m", (Profile("main", "vllm", pool="h100", gpus=gpus, gpu_memory_mib=20 * 1024),),
                  source="org/m", replicas=Replicas(0, 1000))
        plan = place(Catalog((m,)), nodes, [], {"m": count})
        expected = memory_reference(nodes, [], {"m": count}, [m])
        assert len(expected) == count
        assert starts(plan) == expected


def test_two_memory_models_with_many_replicas_each_interleave_as_the_rule_says():
    # p already runs on m00-m04 (the least budget left): p's picks skip them, q's must still find them first.
    nodes = [memory_node(f"m{i:02d}", gib=(80, 80, 80, 80)) for i in range(25)]
    p = Model("p", (Profile("main", "vllm", pool="h100", gpus=1, gpu_memory_mib=20 * 1024),), source="org/p",
              replicas=Replicas(0, 1000))
    q = Model("q", (Profile("main", "vllm", pool="h100", gpus=1, gpu_memory_mib=30 * 1024),), source="org/q",
              replicas=Replicas(0, 1000))
    running = [replica(f"p{i}-{g}", "p", f"m{i:02d}", gpus=(g,), profile="main", memory_mib=40 * 1024)
               for i in range(5) for g in range(4)]
    wanted = {"p": 150, "q": 80}
    plan = place(Catalog((p, q)), nodes, running, wanted)
    expected = memory_reference(nodes, running, wanted, [p, q])
    assert len(expected) == 210
    assert starts(plan) == expected
