"""Which models the router should answer at once, and which it should wait for: the `ModelState`s.

Derived every pass from the replica records and placement's unplaceable list:

- a model with a ready replica gets no state (the router has its endpoints);
- a model with a replica placed or starting on a reporting node is
  `starting`: a request waits for it (the cold start);
- otherwise, a model placement could not place is `unplaceable`, with
  placement's reason and whether the situation can change by itself
  (`can_change_by_itself`: not when placement marked it permanent); a
  request is answered at once;
- anything else (a scale-to-zero model nobody asked for, a crash-looping one
  its agent restarts) gets no state, and a request waits as it always did.

So a model waits only while something is starting, or could start; a model
that needs room nobody is freeing fails fast, with Retry-After, and one the
fleet can never hold fails fast without.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..catalog import Catalog, Model
from ..contracts import ModelCondition, ModelState, ReplicaState
from ..inventory import Node
from ..placement import Unplaceable

_COMING = frozenset({ReplicaState.PENDING, ReplicaState.STARTING})


def model_states(catalog: Catalog, live: Mapping[str, set[ReplicaState]],
                 unplaceable: Mapping[str, Unplaceable | str], nodes: Iterable[Node]) -> tuple[ModelState, ...]:
    """`live`: per model, the states of its replicas on reporting nodes, not being stopped.

    `unplaceable`: per model, placement's record of why (or only its text).
    """
    nodes = tuple(nodes)
    states = []
    for model in catalog.models:
        have = live.get(model.name, ())
        if ReplicaState.READY in have:
            continue
        if any(s in _COMING for s in have):
            states.append(ModelState(model.name, ModelCondition.STARTING))
        elif model.name in unplaceable and ReplicaState.FAILED not in have:
            why = unplaceable[model.name]
            reason = why.reason if isinstance(why, Unplaceable) else why
            states.append(ModelState(model.name, ModelCondition.UNPLACEABLE, reason,
                                     retry=can_change_by_itself(model, why, nodes)))
    return tuple(states)


def can_change_by_itself(model: Model, reason: Unplaceable | str, nodes: Iterable[Node]) -> bool:
    """Could `model` become placeable without anyone changing the fleet or the catalog?

    The one seam for that judgement. Placement decides it: an `Unplaceable`
    marked permanent (no node has the pool or the engine, the largest node
    or GPU is too small) cannot, anything else (room held now, nodes
    unreachable or draining, victims still leaving) can.

    A reason that is only text (no placement record behind it) is judged
    from the inventory, conservatively -- a wrong "never" makes clients give
    up on a model that would have come, a wrong "retry" only costs them a
    retry: only when no profile of the model has a node, reporting or lost,
    that carries its pool and has as many GPUs in all as it needs is the
    answer no. A node that lacks the engine still counts as a possible home
    (its agent may find the engine on a later report); one that is merely
    full or lost counts too (replicas end, nodes come back).
    """
    if isinstance(reason, Unplaceable):
        return not reason.permanent
    sizes: dict[str | None, int] = {}
    for node in nodes:
        gpus = len(node.gpus)
        sizes[None] = max(sizes.get(None, 0), gpus)
        for pool in node.pools:
            sizes[pool] = max(sizes.get(pool, 0), gpus)
    if not sizes:
        return True     # no agent has reported yet: they are on their way
    return any(p.pool in sizes and sizes[p.pool] >= p.gpus for p in model.profiles)
