"""Placement: which profile of which model runs on which node's GPUs.

Owns one pure function, `place(catalog, nodes, running, wanted, movable) -> Plan`:
from the catalog, the inventory's view of the nodes (GPUs and their memory),
every replica that exists and how many replicas the reconciler wants of each
model, it decides what to start (profile, node, GPU indices), what to stop and
why (scale-down, orphans, rollouts, preemption by a higher-priority model's
minimum), which fallback replicas to move back to their best profile, what to
keep, and which wanted replicas fit nowhere: with a reason an operator can act
on and `Unplaceable.permanent` saying whether waiting can help. A replica of a
profile spanning nodes is a group, placed on distinct nodes all or nothing
and counted and stopped as one replica (`gang`).

It must not know about processes, HTTP or time: no I/O, no clock, no state
of its own between calls. The same inputs always give the same plan, which is
what lets the reconciler call it on every pass and tests call it at fleet
scale. A caller may hand each call the same `Memo`, which only makes a call
whose input is mostly the last one's cheaper, never its plan different.
"""
from .model import Assignment, NodeView, Plan, Running, Stop, Unplaceable
from .place import MODEL_LEFT, REPLACED_NO_ROOM, place
from .tally import REPLACED, SCALED_DOWN, Memo

__all__ = [
    "Assignment", "Memo", "NodeView", "Plan", "Running", "Stop", "Unplaceable", "place",
    "MODEL_LEFT", "REPLACED", "REPLACED_NO_ROOM", "SCALED_DOWN",
]
