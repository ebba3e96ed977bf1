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


def apply(plan: Plan, running) -> list[Running]:
    """What the fleet runs once `plan` is done: stops gone, starts present (current, not yet ready)."""
    stopped = {s.replica_id for s in plan.stop}
    after = [r for r in running if r.replica_id not in stopped]
    for a in plan.start:
        after.append(Running(f"n{next(_new_ids)}", a.model, a.profile, a.node, a.gpu_indices))
    return after
