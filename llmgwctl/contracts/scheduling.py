"""`Scheduling`: whether placement may use a node, as the operator set it (cordon, drain, uncordon).

    schedulable --cordon--> cordoned --drain--> draining --(no replica left)--> drained
         ^                      |                  |                               |
         └──────────────────────┴──── uncordon ────┴───────────────────────────────┘

kubectl's words, as operators of a fleet already say them: a cordoned node
keeps what it runs and gets nothing new; a draining one also has its replicas
replaced elsewhere and stopped; a drained one runs nothing and is ready for its
maintenance. The values are the strings the status JSON, the console and the
control API carry.
"""
from __future__ import annotations

import enum


class Scheduling(str, enum.Enum):
    SCHEDULABLE = "schedulable"     # placement may put replicas here
    CORDONED = "cordoned"           # nothing new is placed here; what runs keeps running
    DRAINING = "draining"           # cordoned, and its replicas are being replaced elsewhere and stopped
    DRAINED = "drained"             # cordoned, and nothing of ours runs here any more

    # As ReplicaState: the value in f-strings and format(), on every Python we support.
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
