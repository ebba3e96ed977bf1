"""`ReplicaState`: the one spelling of where a replica is in its life.

    pending -> starting -> ready -> draining -> stopping -> gone
                   └──────────┴──> failed (restarted with backoff)
    any state on a node that stops reporting -> lost

The agent knows four of them (`AGENT_STATES`: it starts, probes, watches and
stops processes); `pending`, `draining` and `lost` are the controller's, about
traffic and placement. The values are the strings the agent protocol and the
status JSON have always carried, and a member is a `str`, so it goes onto the
wire (json, Prometheus labels, f-strings) as exactly that string.
"""
from __future__ import annotations

import enum


class ReplicaState(str, enum.Enum):
    PENDING = "pending"       # placed by the controller, not yet started by its agent
    STARTING = "starting"     # process launched (or adopted), health check not yet passing
    READY = "ready"           # healthy: in the router's endpoint list
    FAILED = "failed"         # crashed or could not start; restarted with backoff when a retry can help
    DRAINING = "draining"     # out of the router, requests in flight finishing
    STOPPING = "stopping"     # its agent has been told to stop it
    LOST = "lost"             # its node stopped reporting; out of the router

    # str() and format() give the value on every Python we support (3.12
    # changed what a str-mixin enum formats as): log lines, event messages and
    # metric labels say "ready", never "ReplicaState.READY".
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# What an agent may report: the states of a process on its node.
AGENT_STATES = frozenset({ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED, ReplicaState.STOPPING})
