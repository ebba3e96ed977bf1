"""`GroupSlot`: one member's place in a replica that spans several nodes (controller -> agent, in its spec);
`MemberStatus`: how one member stands, in its group's status row (controller -> control API).

A profile with `nodes: N > 1` runs each replica as a *group* of N members,
one per node (catalog/multinode.py). The controller places the members all
together or none, decides every member's rank, the head's address and its
rendezvous ports before any member starts, and hands each member its slot in
its `ReplicaSpec.group`. The head (rank 0) serves the API and is the group's
one endpoint; its replica id is the group's id. The other members are
workers: they join the head's rendezvous and serve nothing themselves.

The engine's driver turns a slot into the engine's own multi-node flags
(vLLM's `--nnodes/--node-rank/--master-addr/--master-port`, workers
`--headless`; data parallel's `--data-parallel-address/-rpc-port/-start-rank`).
The agent reads only `rank`: a worker has no API, so it is ready while its
process runs and is never probed over HTTP (a scrape of a rendezvous port is
known to crash vLLM's multi-node start-up).

In the spec hash: `size` and `parallel` (they shape the process, and come
from the profile). Not in it: the rank, the head's address and ports, which
placement chose, like GPU indices.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..catalog.multinode import MAX_NODES
from .errors import ContractError
from .states import ReplicaState

# A worker member's replica id is the group's id and its rank: `<group>-r<rank>`.
MEMBER_SEP = "-r"


@dataclass(frozen=True, slots=True)
class GroupSlot:
    group: str          # the group's id: its head's replica id
    rank: int           # 0: the head, which serves the API; 1 .. size-1: workers
    size: int           # members in the group, one per node
    parallel: str       # tensor | pipeline | data (catalog/multinode.PARALLEL_MODES)
    head_host: str      # where members reach the head: its node's advertised host
    port: int           # the head's rendezvous port (torch.distributed's master port)
    rpc_port: int = 0   # data parallel's RPC port on the head; 0 unless parallel == data

    @property
    def head(self) -> bool:
        return self.rank == 0

    def member_id(self, rank: int) -> str:
        """The replica id of the member with `rank` in this group."""
        return self.group if rank == 0 else f"{self.group}{MEMBER_SEP}{rank}"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "size": self.size, "parallel": self.parallel,
                "head_host": self.head_host, "port": self.port, "rpc_port": self.rpc_port}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupSlot:
        try:
            slot = cls(group=str(data["group"]), rank=int(data["rank"]), size=int(data["size"]),
                       parallel=str(data["parallel"]), head_host=str(data["head_host"]), port=int(data["port"]),
                       rpc_port=int(data.get("rpc_port") or 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ContractError(f"group slot {dict(data)!r}: {exc}") from None
        # At most MAX_NODES, as the catalog allows: a report's slot comes from a node, and the
        # controller walks a group's ranks.
        if not (2 <= slot.size <= MAX_NODES and 0 <= slot.rank < slot.size and 0 < slot.port <= 65535
                and 0 <= slot.rpc_port <= 65535 and slot.group and slot.head_host):
            raise ContractError(f"group slot {slot.to_dict()!r}: rank, size, ports or head out of range")
        return slot


def group_slot(data: object) -> GroupSlot | None:
    """A spec's `group` from its wire form: None when absent."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ContractError(f"group slot: expected an object, got {type(data).__name__}")
    return GroupSlot.from_dict(data)


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """One member of a replica spanning nodes, in its group's row: where it runs and how it is."""

    rank: int
    id: str
    node: str
    gpus: tuple[int, ...]
    state: ReplicaState
    pid: int | None = None
    restarts: int = 0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "id": self.id, "node": self.node, "gpus": list(self.gpus),
                "state": self.state.value, "pid": self.pid, "restarts": self.restarts, "reason": self.reason}
