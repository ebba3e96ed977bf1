"""Small builders so each placement test reads as its fleet, its catalog and its replicas."""
from __future__ import annotations

import itertools

from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.placement import NodeView, Plan, Running


def node(name: str, gpus: int = 8, pools=("h100",), engines=("vllm", "llamacpp"), schedulable: bool = True) -> NodeView:
    return NodeView(name, frozenset(pools), tuple(range(gpus)), frozenset(engines), schedulable)


def profile(name: str = "h100", engine: str = "vllm", pool: str | None = "h100", gpus: int = 1,
            priority: int = 10) -> Profile:
    return Profile(name, engine, pool=pool, gpus=gpus, priority=priority)


def model(name: str, *profiles: Profile, lo: int = 1, hi: int = 4) -> Model:
    return Model(name, tuple(profiles) or (profile(),), source=f"org/{name}", replicas=Replicas(lo, hi))


def catalog(*models: Model) -> Catalog:
    return Catalog(models)


def replica(rid: str, model: str, node: str, gpus=(0,), profile: str = "h100", **flags) -> Running:
    return Running(rid, model, profile, node, tuple(gpus), **flags)


_new_ids = itertools.count(1_000_000)  # one sequence for the whole run, so ids are never reused


def apply(plan: Plan, running, cat: Catalog | None = None) -> list[Running]:
    """What the fleet runs once `plan` is done: stops gone (a group's every member), starts present (current, not yet ready).

    With `cat`, a start of a profile with gpu_memory holds that much of its GPUs, as the reconciler says.
    """
    stopped = {s.replica_id for s in plan.stop}
    after = [r for r in running if r.replica_id not in stopped and r.group not in stopped]
    profiles = {(m.name, p.name): p for m in cat.models for p in m.profiles} if cat is not None else {}
    for a in plan.start:
        profile = profiles.get((a.model, a.profile))
        memory = (profile.gpu_memory_mib or 0) if profile is not None else 0
        rid = f"n{next(_new_ids)}"
        if not a.members:
            after.append(Running(rid, a.model, a.profile, a.node, a.gpu_indices, memory_mib=memory))
            continue
        # A group: the head under the group's id, the other members as the reconciler names them.
        for rank, (name, gpus) in enumerate(((a.node, a.gpu_indices), *a.members)):
            after.append(Running(rid if rank == 0 else f"{rid}-r{rank}", a.model, a.profile, name, gpus,
                                 group=rid, rank=rank))
    return after


def memory_node(name: str, gib=(24,), free=None, pools=("h100",), engines=("vllm", "llamacpp")) -> NodeView:
    """A node whose GPUs have `gib` GiB each (free: all unless `free` says per GPU)."""
    free = free if free is not None else gib
    return NodeView(name, frozenset(pools), tuple(range(len(gib))), frozenset(engines),
                    memory={i: (t * 1024, f * 1024) for i, (t, f) in enumerate(zip(gib, free))})
