"""`Replica`: one desired replica on this node and, while it has one, its process -- the agent's record.

The agent core (core.py) owns the records and changes them; this module only
says what a record holds, how it is saved (`record()`, for state.py) and how
it is reported (`report()`, for the controller). It knows no engine, no HTTP.
"""
from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
from dataclasses import dataclass, field

from ..backoff import Backoff
from ..contracts import AdapterStatus, ReplicaSpec, ReplicaState, ReportedReplica
from . import state
from .state import Record

# The four states a replica has on its node (contracts.AGENT_STATES).
STARTING, READY, FAILED, STOPPING = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED,
                                     ReplicaState.STOPPING)


@dataclass(eq=False)
class Replica:
    """One desired replica on this node and, while it has one, its process."""

    spec: ReplicaSpec
    backoff: Backoff
    state: ReplicaState = STARTING
    gpu_indices: tuple[int, ...] = ()
    port: int | None = None
    pid: int | None = None
    start_time: int | None = None
    pgid: int | None = None
    popen: subprocess.Popen[bytes] | None = None   # None when adopted: not our child, polled by pid
    health_path: str = "/health"
    started_at: float = 0.0
    restarts: int = 0
    last_exit: int | None = None
    last_log: list[str] = field(default_factory=list)
    reason: str = ""
    next_start: float | None = None         # when a failed replica may start again; None = not by itself
    next_probe: float = 0.0                 # starting: when its health is probed next between passes
    group_task: asyncio.Task[None] | None = None  # stopping, or clearing a crashed engine's leftovers
    # Ready, its health probes failing: how many in a row, since when (health.py).
    misses: int = 0
    first_miss: float = 0.0
    # Set when a ready replica stopped passing its health check and went back
    # to starting: its deadline to pass again runs from here, not from its start.
    unhealthy_since: float | None = None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def record(self) -> Record | None:     # not state.Record: in this class `state` is the field
        if self.pid is None or self.start_time is None or self.pgid is None:
            return None
        spec = dataclasses.replace(self.spec, gpu_indices=self.gpu_indices)
        return state.Record(spec=spec, pid=self.pid, start_time=self.start_time, pgid=self.pgid,
                            port=self.port, restarts=self.restarts, health_path=self.health_path)

    def report(self, url: str | None, adapters: tuple[AdapterStatus, ...] = ()) -> ReportedReplica:
        """What the controller is told of it; `url` where its engine is reached (None: no port yet)."""
        return ReportedReplica(
            id=self.spec.id, spec_hash=self.spec.spec_hash, model=self.spec.model, profile=self.spec.profile,
            engine=self.spec.engine, gpu_indices=self.gpu_indices or self.spec.gpu_indices, port=self.port,
            pid=self.pid, state=self.state, restarts=self.restarts, last_exit=self.last_exit,
            last_log=tuple(self.last_log), url=url, reason=self.reason,
            # The whole spec, so a restarted controller can adopt this replica
            # and keep desiring exactly it (same hash) until it decides to
            # replace it, instead of the agent restarting it on a guessed spec.
            spec=self.spec, adapters=adapters,
        )


def describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown status (not our child)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
