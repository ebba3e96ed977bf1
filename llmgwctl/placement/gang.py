"""Replicas that span nodes (a profile with `nodes: N > 1`): placing one group all or nothing, and seeing one as a replica.

A group is N members, one per node, each on `gpus` whole GPUs of its own
node; the head (rank 0) serves the API and its replica id is the group's id
(`Running.group`). Placement treats a group as ONE replica of its model:

- `one_per_group` stands one `Running` for each group (its head's id, node
  and GPUs) where a model's replicas are counted (`tally`), so a group counts
  once toward wanted, is stopped once (a `Stop` names the group's id: the
  reconciler stops every member) and is never counted member by member. What
  the group *is* follows from its members:

  - ready: only when it is whole (one member for each rank 0..N-1 of its
    profile, all on that profile) and every member is ready; a group with a
    member missing is starting at best, and the reconciler's to stop;
  - failed: any member failed (one member down is the group down);
  - lost: any member lost, or on a node the inventory does not have (nobody
    can stop it there, as for a replica on one node);
  - leaving: any member leaving (the reconciler is stopping it);
  - current: every member current (a profile change reaches every member).

  Each member holds its own node's GPUs and a replica slot there, whatever
  the group's state: `fleet.Held` is built from every `Running`, members too.

- `place_group` finds N distinct nodes for a missing replica before taking
  anything (`Fleet.pick_apart`: spread first, then best-fit, then the name,
  as `Fleet.pick` chooses one node), then takes all N. If fewer than N fit,
  nothing is taken: `Fleet.take` cannot be undone within a pass, so a half
  group would hold GPUs nothing will use.

It knows nothing about ranks' addresses or ports (the reconciler's), only
where each member's GPUs are: an `Assignment`'s `node`/`gpu_indices` are the
head's and `members` the other ranks' in order.
"""
from __future__ import annotations

from collections.abc import Container, Mapping, MutableMapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from .fleet import Fleet
from .model import Assignment, Running

if TYPE_CHECKING:
    from ..catalog import Profile


def one_per_group(replicas: Sequence[Running], sizes: Mapping[str, int], nodes: Container[str]
                  ) -> tuple[list[Running], dict[str, tuple[Running, ...]]]:
    """(the replicas with each group stood for by one `Running`, where its first member was; each group's members by rank).

    `sizes` maps a profile name to its `nodes`: a group whose profile is not in
    it (it left the model) cannot be whole. `nodes`: the inventory's node names.
    """
    out: list[Running] = []
    at: dict[str, int] = {}
    members: dict[str, list[Running]] = {}
    for r in replicas:
        if r.group is None:
            out.append(r)
        elif r.group in members:
            members[r.group].append(r)
        else:
            at[r.group] = len(out)
            out.append(r)
            members[r.group] = [r]
    ordered = {}
    for group, found in members.items():
        found.sort(key=lambda m: m.rank)
        ordered[group] = tuple(found)
        out[at[group]] = _whole(group, found, sizes, nodes)
    return out, ordered


def _whole(group: str, members: Sequence[Running], sizes: Mapping[str, int], nodes: Container[str]) -> Running:
    head = members[0]                   # rank 0 when present; the lowest rank of a group missing its head
    size = sizes.get(head.profile, 0)
    whole = ([m.rank for m in members] == list(range(size))
             and all(m.profile == head.profile for m in members))
    return replace(
        head, replica_id=group, rank=0,
        current=all(m.current for m in members),
        ready=whole and all(m.ready for m in members),
        failed=any(m.failed for m in members),
        lost=any(m.lost or m.node not in nodes for m in members),
        leaving=any(m.leaving for m in members))


def place_group(fleet: Fleet, model: str, profile: Profile, spread: MutableMapping[str, int],
                replaces: str | None = None) -> Assignment | None:
    """Take room for one group of `profile` on `profile.nodes` distinct nodes, or take nothing and return None.

    Every member's node is added to `spread`, so the model's next replica avoids them all.
    """
    names = fleet.pick_apart(profile.pool, profile.engine, profile.gpus, profile.nodes, spread)
    if names is None:
        return None
    (head, gpus), *rest = [(name, fleet.take(name, profile.gpus)) for name in names]
    for name in names:
        spread[name] += 1
    return Assignment(model, profile.name, head, gpus, replaces=replaces, members=tuple(rest))
