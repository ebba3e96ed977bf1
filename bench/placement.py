"""How long one placement pass takes at fleet scale, next to two baselines measured in the same run.

For each fleet (nodes x 8 GPUs of 80 GiB, a few with memory held outside
llmgw) and catalog (mixed profiles: pools, 1/2/4/8 GPUs, a third of them
stating gpu_memory so they share GPUs, 0-GPU llama.cpp fallbacks, replicas
min 1 max 4, model priorities 0-2):

  full pass   empty fleet -> every wanted replica placed (or reported unplaceable)
  no-op pass  the full pass's plan applied, every replica ready -> an empty plan
  floor       touching every input once: each replica's GPUs taken off its
              node's free set, replicas counted per model. No placer can do less
              than this, so no-op / floor is what placement's own work costs.
  scan        the same full pass done the obvious way: for each replica, every
              node checked for pool, engine, free GPUs and spread (O(nodes) per
              replica). full / scan is what the free-GPU index buys.

Then preemption, at 5,000 nodes x 8 GPUs and 1,000 models: 900 priority-0
models fill every GPU of the fleet (a quarter of their replicas sharing GPUs
by memory), and 100 priority-10 models, absent until now, each need their
minimum of one replica of 8 GPUs:

  preempt pass   the full fleet, every replica ready -> victims chosen for
                 all 100 (the plan's stops), each on one node where it fits
  drain pass     those victims leaving (draining) -> no further stop: the
                 preemptors wait for the room already coming free

Then one model wanting 1,000 replicas at once on the empty 5,000-node fleet
(a rolling change or a scale-up of one big model), once taking whole GPUs and
once sharing them by memory: every replica placed lands beside the ones before
it in the index, so this is where a pick that walks past the model's own
nodes costs most.

  one model pass   empty fleet -> 1,000 replicas of one model placed

Then gangs (issue 32): the 5,000-node fleet and 1,000-model catalog of the
first table, once as it is (today's figures, measured again in this run)
and once with 100 more models whose only profile spans 2-4 nodes of 4 or 8
GPUs each (wanted 1-2 groups each); full and no-op pass of each, and the
ratio of the two in the same run. The no-op pass runs every group as its
members (one Running per node, with group and rank) and must be empty.

    python3 -m bench.placement [--repeat 5] [--seed 1]

The whole run takes well under two minutes on a 2-core machine (the scan
baseline, run once per size rather than best of N, is most of it).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.placement import NodeView, Plan, Running, place

T = TypeVar("T")

GPUS_PER_NODE = 8
POOLS = ("h100", "a100", "l40s")
# (nodes, models): a small fleet with a matching catalog, the same fleet
# swamped by 1,000 models (most replicas unplaceable, the reason path), and
# the big fleets with the biggest catalog the brief asks for.
SIZES = ((50, 100), (50, 1000), (500, 1000), (5000, 1000))


GPU_MIB = 80 * 1024


def fleet(n: int, rng: random.Random) -> list[NodeView]:
    nodes = []
    for i in range(n):
        pool = POOLS[i % len(POOLS)]
        engines = {"vllm", "sglang"} | ({"llamacpp"} if i % 3 == 0 else set())
        # One node in ten has a GPU with 20 GiB held by something outside llmgw.
        memory = {g: (GPU_MIB, GPU_MIB - (20 * 1024 if g == 0 and i % 10 == 0 else 0)) for g in range(GPUS_PER_NODE)}
        nodes.append(NodeView(f"node-{i:05d}", frozenset({pool}), tuple(range(GPUS_PER_NODE)), frozenset(engines),
                              schedulable=rng.random() > 0.02,    # a few nodes draining or unreachable
                              memory=memory))
    return nodes


def catalog(n: int, rng: random.Random) -> Catalog:
    models = []
    for i in range(n):
        gpus = rng.choice((1, 1, 1, 2, 2, 4, 8))          # most models are small, as in real fleets
        # A third state their memory (small models share a GPU); the rest take whole GPUs.
        memory = rng.choice((10, 20, 40)) * 1024 if gpus <= 2 and rng.random() < 0.5 else None
        profiles = [Profile("main", rng.choice(("vllm", "sglang")), pool=rng.choice(POOLS), gpus=gpus, priority=10,
                            gpu_memory_mib=memory)]
        if rng.random() < 0.3:
            profiles.append(Profile("alt", "vllm", pool=rng.choice(POOLS), gpus=gpus * 2 if gpus < 8 else 8,
                                    priority=5))
        if rng.random() < 0.5:
            profiles.append(Profile("cpu", "llamacpp", gpus=0, priority=1))
        models.append(Model(f"model-{i:04d}", tuple(profiles), source=f"org/model-{i}", replicas=Replicas(1, 4),
                            priority=rng.choice((0, 1, 2))))
    return Catalog(models)


def applied(plan: Plan, running: list[Running], cat: Catalog) -> list[Running]:
    stopped = {s.replica_id for s in plan.stop}
    memory = {(m.name, p.name): p.gpu_memory_mib or 0 for m in cat.models for p in m.profiles}
    out = [r for r in running if r.replica_id not in stopped]
    for i, a in enumerate(plan.start, start=len(running)):
        rid = f"r-{i}"
        if not a.members:
            out.append(Running(rid, a.model, a.profile, a.node, a.gpu_indices, ready=True,
                               memory_mib=memory[(a.model, a.profile)]))
            continue
        # A group: its head under the group's id, each other member on its own node.
        for rank, (node, gpus) in enumerate(((a.node, a.gpu_indices), *a.members)):
            out.append(Running(rid if rank == 0 else f"{rid}-r{rank}", a.model, a.profile, node, gpus, ready=True,
                               group=rid, rank=rank))
    return out


GANG_MODELS = 100


def gang_models(rng: random.Random) -> list[Model]:
    """100 models whose one profile spans 2-4 nodes of 4 or 8 GPUs each, 1-2 groups each."""
    return [Model(f"gang-{i:03d}", (Profile("main", "vllm", pool=rng.choice(POOLS), gpus=rng.choice((4, 8)),
                                            priority=10, nodes=rng.choice((2, 3, 4))),),
                  source=f"org/gang-{i}", replicas=Replicas(1, 2), priority=rng.choice((0, 1, 2)))
            for i in range(GANG_MODELS)]


def reported(nodes: list[NodeView], running: list[Running]) -> list[NodeView]:
    """The nodes as their agents report them once `running` (all ready) allocated their memory."""
    used: dict[tuple[str, int], int] = defaultdict(int)
    for r in running:
        for g in r.gpu_indices:
            used[(r.node, g)] += r.memory_mib
    return [NodeView(n.name, n.pools, n.gpus, n.engines, n.schedulable,
                     memory={g: (t, f - used[(n.name, g)]) for g, (t, f) in n.memory.items()}) for n in nodes]


PREEMPTORS = 100
# A big rolling change: the fleet bench's is 1,000 replicas of one model.
ONE_MODEL_REPLICAS = 1000


def preemption_case(n_nodes: int, rng: random.Random) -> tuple[Catalog, list[NodeView], list[Running], dict[str, int]]:
    """A fleet full of priority-0 replicas and 100 priority-10 models short of their minimum."""
    nodes = fleet(n_nodes, rng)
    for node in nodes:
        object.__setattr__(node, "schedulable", True)
    fillers = 900
    models = [Model(f"fill-{i:03d}", (Profile("main", "vllm", gpus=1, gpu_memory_mib=(40 * 1024 if i % 4 == 0 else None)),),
                    source=f"org/fill-{i}", replicas=Replicas(1, 100)) for i in range(fillers)]
    models += [Model(f"prod-{i:03d}", (Profile("main", "vllm", pool=POOLS[i % len(POOLS)], gpus=8, priority=10),),
                     source=f"org/prod-{i}", replicas=Replicas(1, 1), priority=10) for i in range(PREEMPTORS)]
    cat = Catalog(models)
    running: list[Running] = []
    wanted, k = {m.name: 0 for m in models}, 0
    for node in nodes:
        for g in node.gpus:
            # Two 40 GiB replicas share a GPU for the memory fillers, one whole-GPU replica otherwise.
            model = models[k % fillers]
            share = 2 if model.profiles[0].gpu_memory_mib else 1
            for _ in range(share):
                running.append(Running(f"f-{len(running)}", model.name, "main", node.name, (g,), ready=True,
                                       memory_mib=model.profiles[0].gpu_memory_mib or 0))
                wanted[model.name] += 1
            k += 1
    # Inside the catalog's bounds: each filler wants what it runs (45, or 90 sharing, of max 100).
    wanted.update({f"prod-{i:03d}": 1 for i in range(PREEMPTORS)})
    return cat, reported(nodes, running), running, wanted


def floor(nodes: list[NodeView], running: list[Running]) -> None:
    free = {n.name: set(n.gpus) for n in nodes}
    per_model: Counter[str] = Counter()
    for r in running:
        free[r.node].difference_update(r.gpu_indices)
        per_model[r.model] += 1


def scan(cat: Catalog, nodes: list[NodeView], wanted: dict[str, int]) -> int:
    """The obvious placer (no index): every node looked at for every replica. Returns replicas placed."""
    free = {n.name: list(n.gpus) for n in nodes}
    placed = 0
    for model in cat.models:
        spread: dict[str, int] = defaultdict(int)
        for _ in range(wanted[model.name]):
            for p in model.ranked():
                best, best_key = None, None
                for n in nodes:
                    if (n.schedulable and p.engine in n.engines and (p.pool is None or p.pool in n.pools)
                            and len(free[n.name]) >= p.gpus):
                        key = (spread[n.name], len(free[n.name]), n.name)
                        if best_key is None or key < best_key:
                            best, best_key = n.name, key
                if best is not None:
                    free[best] = free[best][p.gpus:]
                    spread[best] += 1
                    placed += 1
                    break
    return placed


def timed(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """The best time of `repeat` calls (at least one), and the last call's result."""
    best = float("inf")
    for _ in range(repeat - 1):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    start = time.perf_counter()
    result = fn()
    return min(best, time.perf_counter() - start), result


def case(n_nodes: int, n_models: int, seed: int) -> tuple[list[NodeView], Catalog, dict[str, int]]:
    """The fleet, the catalog and the wanted counts of one row of the first table."""
    rng = random.Random(seed)
    nodes, cat = fleet(n_nodes, rng), catalog(n_models, rng)
    return nodes, cat, {m.name: rng.randint(m.replicas.min, m.replicas.max) for m in cat.models}


def full_and_noop(cat: Catalog, nodes: list[NodeView], wanted: dict[str, int], repeat: int,
                  label: str) -> tuple[float, Plan, list[Running], float] | None:
    """(full pass time, its plan, what runs once it is applied, no-op pass time), or None if the no-op plan was not empty."""
    full_s, plan = timed(partial(place, cat, nodes, [], wanted), repeat)
    running = applied(plan, [], cat)
    noop_s, again = timed(partial(place, cat, reported(nodes, running), running, wanted), repeat)
    if again.start or again.stop:
        print(f"BUG: the no-op pass {label} was not empty: {len(again.start)} starts, {len(again.stop)} stops",
              file=sys.stderr)
        return None
    return full_s, plan, running, noop_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Best of 5: the dev machine is two shared cores, and the minimum is the
    # run least disturbed by neighbours, the number that compares across runs.
    parser.add_argument("--repeat", type=int, default=5, help="best of N for each timing (default 5)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    began = time.perf_counter()
    rows = []
    for n_nodes, n_models in SIZES:
        nodes, cat, wanted = case(n_nodes, n_models, args.seed)
        passes = full_and_noop(cat, nodes, wanted, args.repeat, f"at {n_nodes} nodes")
        if passes is None:
            return 1
        full_s, plan, running, noop_s = passes
        floor_s, _ = timed(partial(floor, nodes, running), args.repeat)
        # Once: it is the slow one, and its spread is small next to the ratio it shows.
        scan_s, _ = timed(partial(scan, cat, nodes, wanted), 1)
        rows.append((n_nodes, n_models, sum(wanted.values()), len(plan.start), len(plan.unplaceable),
                     full_s, noop_s, floor_s, scan_s))

    print(f"| nodes x {GPUS_PER_NODE} GPUs | models | wanted | placed | unplaceable | full pass | per replica "
          "| no-op pass | no-op / floor | full / scan |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n_nodes, n_models, want, placed, unplaced, full_s, noop_s, floor_s, scan_s in rows:
        vs_scan = f"{full_s / scan_s:.3f}x of {scan_s * 1000:,.0f} ms"
        print(f"| {n_nodes:,} | {n_models:,} | {want:,} | {placed:,} | {unplaced:,} | {full_s * 1000:,.1f} ms "
              f"| {full_s / want * 1e6:,.1f} µs | {noop_s * 1000:,.1f} ms "
              f"| {noop_s / floor_s:.1f}x of {floor_s * 1000:,.2f} ms | {vs_scan} |")

    rng = random.Random(args.seed)
    cat, nodes, running, wanted = preemption_case(5000, rng)
    preempt_s, plan = timed(lambda: place(cat, nodes, running, wanted), args.repeat)
    preemptors = {s.preempted_by for s in plan.stop}
    if len(preemptors) != PREEMPTORS or plan.start:
        print(f"BUG: preemption made room for {len(preemptors)} of {PREEMPTORS} models", file=sys.stderr)
        return 1
    stopping = {s.replica_id for s in plan.stop}
    leaving = [Running(**{**{f: getattr(r, f) for f in Running.__slots__}, "leaving": r.replica_id in stopping})
               for r in running]
    drain_s, again = timed(lambda: place(cat, nodes, leaving, wanted), args.repeat)
    if again.stop or again.start:
        print(f"BUG: while victims drain, {len(again.stop)} more stops and {len(again.start)} starts", file=sys.stderr)
        return 1
    print(f"\n| preemption, {len(nodes):,} nodes x {GPUS_PER_NODE} GPUs | models | replicas | preemptors "
          "| victims | pass |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| preempt pass (full fleet) | {len(cat):,} | {len(running):,} | {len(preemptors)} | {len(plan.stop):,} "
          f"| {preempt_s * 1000:,.1f} ms |")
    print(f"| drain pass (victims leaving) | {len(cat):,} | {len(running):,} | {PREEMPTORS} waiting | 0 more "
          f"| {drain_s * 1000:,.1f} ms |")
    rng = random.Random(args.seed)
    nodes = fleet(5000, rng)
    print(f"\n| one model, {len(nodes):,} nodes x {GPUS_PER_NODE} GPUs (empty) | replicas | placed | pass "
          "| per replica |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, memory in (("whole GPU each", None), ("20 GiB of a GPU each", 20 * 1024)):
        cat = Catalog([Model("big", (Profile("main", "vllm", gpus=1, gpu_memory_mib=memory),), source="org/big",
                             replicas=Replicas(1, ONE_MODEL_REPLICAS))])
        wanted = {"big": ONE_MODEL_REPLICAS}
        one_s, plan = timed(partial(place, cat, nodes, [], wanted), args.repeat)
        if len(plan.start) != ONE_MODEL_REPLICAS:
            print(f"BUG: {len(plan.start)} of {ONE_MODEL_REPLICAS} replicas of one model placed", file=sys.stderr)
            return 1
        print(f"| {label} | {ONE_MODEL_REPLICAS:,} | {len(plan.start):,} | {one_s * 1000:,.1f} ms "
              f"| {one_s / ONE_MODEL_REPLICAS * 1e6:,.1f} µs |")
    if gangs(args) != 0:
        return 1
    print(f"\nwhole run: {time.perf_counter() - began:.1f} s (python {sys.version.split()[0]})")
    return 0


def gangs(args: argparse.Namespace) -> int:
    """The largest fleet and catalog of the first table, without and with 100 gang models, side by side."""
    n_nodes, n_models = SIZES[-1]
    rows = []
    for label, with_gangs in (("today's catalog", False), (f"+ {GANG_MODELS} gang models", True)):
        nodes, cat, wanted = case(n_nodes, n_models, args.seed)
        if with_gangs:
            extra = gang_models(random.Random(args.seed + 1))
            cat = Catalog((*cat.models, *extra))
            wanted.update({m.name: 1 + i % 2 for i, m in enumerate(extra)})
        passes = full_and_noop(cat, nodes, wanted, args.repeat, f"with {label}")
        if passes is None:
            return 1
        full_s, plan, running, noop_s = passes
        groups = [a for a in plan.start if a.members]
        if with_gangs and not groups:
            print("BUG: no gang model was placed", file=sys.stderr)
            return 1
        rows.append((label, len(cat), sum(wanted.values()), len(plan.start), len(groups),
                     sum(1 + len(a.members) for a in groups), len(plan.unplaceable), len(running), full_s, noop_s))
    base_full, base_noop = rows[0][-2], rows[0][-1]
    print(f"\n| gangs, {n_nodes:,} nodes x {GPUS_PER_NODE} GPUs | models | wanted | placed | of them groups "
          "| members | unplaceable | running after | full pass | x today | no-op pass | x today |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, models, want, placed, groups_n, members_n, unplaced, after_n, full_s, noop_s in rows:
        print(f"| {label} | {models:,} | {want:,} | {placed:,} | {groups_n} | {members_n} | {unplaced:,} "
              f"| {after_n:,} | {full_s * 1000:,.1f} ms | {full_s / base_full:.2f}x | {noop_s * 1000:,.1f} ms "
              f"| {noop_s / base_noop:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
