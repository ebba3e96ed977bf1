"""A pass's plan and its carrying out: placement called (or its last plan taken again), replicas drained, started, moved.

`Planner` owns what placement may reuse from one call to the next (its memo
and its last plan), the moves back to a model's best profile (rate-limited
per model), what could not be placed and why, and the drain of replicas on
their way out. Placement itself is the pure function `placement.place`.
"""
from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ..catalog import Catalog, Model, Profile
from ..catalog.multinode import parallelism
from ..contracts import GroupSlot, ReplicaSpec, ReplicaState, UsageSnapshot
from ..contracts.usage import UNUSED
from ..placement import Assignment, Memo, NodeView, Running, Stop, Unplaceable, place
from .groups import GroupKeeper
from .placement_input import profile_of
from .records import Records, Replica, is_worker

_LEAVING = (ReplicaState.DRAINING, ReplicaState.STOPPING)


class Planner:
    """Placement's answer, applied to the records."""

    def __init__(self, records: Records, event: Callable[[str, str], None], *, move_every: float, drain_grace: float,
                 groups: GroupKeeper | None = None):
        # `groups`: the rendezvous ports and heads' hosts of groups spanning nodes; needed only to start one.
        self.records, self._event, self.groups = records, event, groups
        self.move_every, self.drain_grace = move_every, drain_grace
        # Back to the best profile: when each model last started a move, and
        # which fallback each surge replica is to replace (new id -> old id).
        self.moved: dict[str, float] = {}
        self._moving: dict[str, str] = {}
        self.unplaceable: dict[str, str] = {}
        # The same, whole: `unplaceable_detail[model].permanent` says whether
        # waiting can help (the router answers at once when it cannot).
        self.unplaceable_detail: dict[str, Unplaceable] = {}
        # The last call of place(): (catalog, views, running, wanted, movable, plan).
        self._last_plan: tuple[Catalog, list[NodeView], list[Running], dict[str, int], set[str], Any] | None = None
        # What place() may reuse from one call to the next where the input is the same (per node, per model):
        # a pass where few replicas changed costs what changed, not the fleet.
        self._memo = Memo()

    def plan(self, catalog: Catalog, now: float, wanted: dict[str, int], running: list[Running],
             views: list[NodeView]) -> None:
        """Place, then drain what the plan stops and record what it starts."""
        # Moves back to the best profile are rate-limited per model (reconciler.MOVE_EVERY).
        movable = {m.name for m in catalog.models if now - self.moved.get(m.name, -self.move_every) >= self.move_every}
        # Placement is a pure function: handed the very input of the last call
        # (the kept NodeViews and Runnings, see PlacementInput), it would
        # answer the same plan, so that plan is taken again -- a pass that
        # changes nothing places nothing at no cost. Views are compared by
        # identity: their equality leaves out memory and engine reasons,
        # which placement reads.
        last = self._last_plan
        if (last is not None and last[0] is catalog and last[3] == wanted and last[4] == movable
                and last[2] == running and len(last[1]) == len(views)
                and all(a is b for a, b in zip(last[1], views))):
            plan = last[5]
        else:
            plan = place(catalog, views, running, wanted, movable=movable, memo=self._memo)
            self._last_plan = (catalog, views, running, dict(wanted), set(movable), plan)
        self._stop(plan.stop, now)
        self._start(catalog, plan.start, {n.name: n.memory for n in views}, now)
        records = self.records
        # A surge that finished (its fallback is gone) or was given up (it is gone) is forgotten.
        self._moving = {new: old for new, old in self._moving.items() if new in records and old in records
                        and records[old].state not in _LEAVING}
        detail = {u.model: u for u in plan.unplaceable}
        for name, u in detail.items():
            if self.unplaceable.get(name) != u.reason:
                self._event("unplaceable", f"{name}{' (permanent)' if u.permanent else ''}: {u.reason}")
        self.unplaceable = {name: u.reason for name, u in detail.items()}
        self.unplaceable_detail = detail

    def _stop(self, stops: tuple[Stop, ...], now: float) -> None:
        records = self.records
        moved_by = {old: new for new, old in self._moving.items()}
        for stop in stops:
            rec = records.get(stop.replica_id)
            if rec is not None and rec.state not in _LEAVING:
                reason = stop.reason
                new = moved_by.get(stop.replica_id)
                if new is not None and new in records:
                    reason = f"moved back to profile {records[new].spec.profile}: {new} is ready"
                rec.state, rec.drain_since, rec.drain_reason = ReplicaState.DRAINING, now, reason
                if stop.preempted_by:
                    self._event("replica-preempted", f"{rec.spec.id} ({rec.spec.model}/{rec.spec.profile} on {rec.node}) "
                                                     f"{reason}")
                else:
                    self._event("replica-draining", f"{rec.spec.id} ({rec.spec.model} on {rec.node}): {reason}")

    def _start(self, catalog: Catalog, starts: tuple[Assignment, ...], gpus_of: Mapping[str, Mapping[int, tuple[int, int]]], now: float) -> None:
        for a in starts:
            model = catalog.resolve(a.model)
            profile = profile_of(model, a.profile)
            # place() starts only a model it took from this catalog, with one of that model's profiles.
            assert model is not None and profile is not None
            if a.members:
                self._start_group(catalog, model, profile, a, now)
                continue
            rid = new_id(model.name)
            share = memory_share(profile.gpu_memory_mib, gpus_of.get(a.node, {}), a.gpu_indices)
            spec = ReplicaSpec.for_profile(rid, model, profile, catalog.engines[profile.engine], a.gpu_indices,
                                           gpu_memory_share=share)
            self.records[rid] = Replica(spec=spec, node=a.node, created=now)
            where = f"{a.node} GPUs {list(a.gpu_indices) or 'none'}"
            if share is not None:
                where += f" ({share:.0%} of their memory each)"
            if a.replaces is not None:
                self.moved[model.name] = now
                self._moving[rid] = a.replaces
                self._event("replica-moving", f"{rid} ({model.name}/{profile.name}) on {where}: replaces fallback "
                                              f"{a.replaces} once ready")
            else:
                self._event("replica-placed", f"{rid} ({model.name}/{profile.name}) on {where}")

    def _start_group(self, catalog: Catalog, model: Model, profile: Profile, a: Assignment, now: float) -> None:
        """A replica spanning nodes: a record per member, every one's slot (rank, head, ports) decided now."""
        assert self.groups is not None, "a Planner that starts groups is given their keeper"
        group = new_id(model.name)
        split = parallelism(profile) or "pipeline"
        ports = self.groups.ports(a.node, group, 2 if split == "data" else 1)
        head = GroupSlot(group=group, rank=0, size=1 + len(a.members), parallel=split,
                         head_host=self.groups.host_of(a.node), port=ports[0],
                         rpc_port=ports[1] if len(ports) > 1 else 0)
        engine = catalog.engines[profile.engine]
        where = []
        for rank, (node, indices) in enumerate(((a.node, a.gpu_indices), *a.members)):
            slot = dataclasses.replace(head, rank=rank)     # the head's slot, but for the rank
            spec = ReplicaSpec.for_profile(slot.member_id(rank), model, profile, engine, indices, group=slot)
            self.records[spec.id] = Replica(spec=spec, node=node, created=now)
            where.append(f"rank {rank} on {node} GPUs {list(indices) or 'none'}")
        self._event("replica-placed", f"{group} ({model.name}/{profile.name}, {split} parallel across "
                                      f"{head.size} nodes, rendezvous {head.head_host}:{head.port}): "
                                      + "; ".join(where))

    def drain(self, now: float, usage: UsageSnapshot) -> None:
        """Draining replicas whose requests are done, or whose grace ran out, are told to stop."""
        for rec in self.records.values():
            if rec.state != ReplicaState.DRAINING or is_worker(rec.spec):
                continue        # a worker follows its group's head (groups.py), which takes the requests
            _, inflight = usage.get(rec.spec.id, UNUSED)
            # Only a plan and Adoption.trim make a replica DRAINING, and both set drain_since
            # (an agent cannot report DRAINING: it is not in AGENT_STATES, so adoption never brings it).
            assert rec.drain_since is not None
            if inflight == 0 or now - rec.drain_since >= self.drain_grace:
                rec.state = ReplicaState.STOPPING
                why = "drained" if inflight == 0 else f"drain grace over with {inflight} in flight"
                self._event("replica-stopping", f"{rec.spec.id} ({rec.spec.model} on {rec.node}): {why}")


def memory_share(need_mib: int | None, memory: Mapping[int, tuple[int, int]],
                 indices: tuple[int, ...]) -> float | None:
    """A profile's need as a fraction of its GPUs' memory (the smallest of them); None for whole GPUs."""
    if not need_mib or not indices:
        return None
    totals = [memory.get(i, (0, 0))[0] for i in indices]
    if min(totals) <= 0:
        return None                 # placement never shares a GPU of unknown memory
    return min(1.0, need_mib / min(totals))


def new_id(model: str) -> str:
    # Chosen once by the controller and never reused: a short model slug for
    # people reading logs, and random bits so a restarted controller (which
    # keeps no database) cannot collide with an id it handed out before.
    slug = "".join(c if c.isalnum() else "-" for c in model.lower()).strip("-")[:24] or "replica"
    return f"{slug}-{uuid.uuid4().hex[:8]}"
