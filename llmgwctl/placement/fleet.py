"""Free GPUs per node during one placement pass, indexed so picking a node does not scan the fleet.

One `Fleet` lives for one call of `place()`. It starts from the inventory,
marks every existing replica's GPUs as taken, and then only ever takes more:
nothing is freed inside a pass (a replica being stopped keeps its GPUs until it
is gone, and the next pass sees the room). That monotonicity is what keeps the
index cheap and exact:

- Nodes that could run a profile form a *group* keyed by (pool, engine). A group
  is built the first time a profile asks for it, so a pass that places nothing
  (the no-op pass, the common case) builds none.
- Inside a group, nodes sit in buckets by free-GPU count, each bucket a heap of
  node names. Best-fit is "the first bucket at or above the profile's GPU count
  that has a usable node"; the heap gives the lowest name for determinism.
- When a node's free count drops it is pushed into its new bucket; the entry in
  the old bucket is dropped lazily when it reaches the top (its count no longer
  matches). Counts only fall, so a node never comes back to a bucket it left
  and an entry is never duplicated.
- A node also has a number of replica slots (MAX_REPLICAS_PER_NODE less what
  it runs), which only fall too; a node out of slots leaves every bucket the
  same lazy way.
- If a (pool, engine, gpus) asked for finds no node, no later request in the
  pass can find one either; it is remembered as full.

It knows nodes and GPU counts, nothing about models beyond the per-node replica
counts the caller passes in for spreading.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Mapping, Sequence

from .model import NodeView

# The most replicas one node runs, whatever their GPUs. Each replica is an
# engine process on a port of its own, and an agent's default port range
# (20000-20999) holds 1000; without a cap, profiles needing no GPU fit any node
# without end, and a catalog at its bounds (100,000 replicas) would pile them
# all on a few CPU nodes -- records the reconciler walks on every pass for
# engines that could never start. With it, a pass's work follows the fleet.
MAX_REPLICAS_PER_NODE = 1000


class _Group:
    """The schedulable nodes of one pool (or all pools) whose agents run one engine."""

    __slots__ = ("members", "buckets", "counts")

    def __init__(self) -> None:
        self.members: set[str] = set()
        self.buckets: dict[int, list[str]] = {}   # free GPUs -> heap of node names
        self.counts: list[int] = []                # sorted keys of `buckets`

    def push(self, name: str, free: int) -> None:
        heap = self.buckets.get(free)
        if heap is None:
            heap = self.buckets[free] = []
            bisect.insort(self.counts, free)
        heapq.heappush(heap, name)


class Fleet:
    def __init__(self, nodes: Sequence[NodeView]):
        self.nodes: dict[str, NodeView] = {}
        for node in nodes:
            if node.name in self.nodes:
                raise ValueError(f"node {node.name!r} appears twice in the inventory given to placement")
            self.nodes[node.name] = node
        self.free: dict[str, list[int]] = {n.name: sorted(set(n.gpus)) for n in nodes}
        # Replicas each node may still take (MAX_REPLICAS_PER_NODE less what runs
        # there); like free GPUs, it only falls during a pass.
        self.slots: dict[str, int] = {n.name: MAX_REPLICAS_PER_NODE for n in nodes}
        self._by_pool: dict[str, list[str]] | None = None
        self._groups: dict[tuple[str | None, str], _Group] = {}
        self._member_of: dict[str, list[_Group]] = {}
        self._full: set[tuple[str | None, str, int]] = set()

    # -- reading ----------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.nodes

    def free_count(self, name: str) -> int:
        return len(self.free[name])

    def in_pool(self, pool: str | None) -> list[str]:
        """Names of the nodes carrying `pool` (every node for None), in inventory order."""
        if pool is None:
            return list(self.nodes)
        if self._by_pool is None:
            self._by_pool = {}
            for node in self.nodes.values():
                for label in node.pools:
                    self._by_pool.setdefault(label, []).append(node.name)
        return self._by_pool.get(pool, [])

    def can_host(self, name: str, pool: str | None, engine: str) -> bool:
        """Could `name` ever run a profile of this pool and engine (ignoring free GPUs)?"""
        node = self.nodes.get(name)
        return (node is not None and node.schedulable and engine in node.engines
                and (pool is None or pool in node.pools))

    # -- changing ---------------------------------------------------------

    def occupy(self, name: str, indices: Sequence[int]) -> None:
        """Mark GPUs of an existing replica taken. Only before the first pick (groups read counts once)."""
        free = self.free.get(name)
        if free is None:
            return
        self.slots[name] -= 1
        for index in indices:
            pos = bisect.bisect_left(free, index)
            if pos < len(free) and free[pos] == index:
                del free[pos]

    def pick(self, pool: str | None, engine: str, gpus: int, spread: Mapping[str, int]) -> str | None:
        """The node for one more replica, or None when no node of this kind has `gpus` free.

        Spread first: a node without a replica of the model (`spread` maps node
        name -> that model's replicas there) beats any node with one. Then
        best-fit: the fewest free GPUs that still fit, so whole machines stay
        free for the models that need them. Then the name, for determinism.
        """
        if (pool, engine, gpus) in self._full:
            return None
        group = self._group(pool, engine)
        for free in group.counts[bisect.bisect_left(group.counts, gpus):]:
            heap = group.buckets[free]
            skipped: list[str] = []
            found = None
            while heap:
                name = heap[0]
                if len(self.free[name]) != free or self.slots[name] <= 0:
                    heapq.heappop(heap)        # it moved to a smaller bucket, or is full for this pass
                elif spread.get(name):
                    skipped.append(heapq.heappop(heap))
                else:
                    found = name
                    break
            for name in skipped:
                heapq.heappush(heap, name)
            if found is not None:
                return found
        # Every node that fits already runs this model: fewest of its replicas, then best-fit.
        best, best_key = None, None
        for name, count in spread.items():
            free = len(self.free.get(name, ()))
            if count and name in group.members and free >= gpus and self.slots[name] > 0:
                key = (count, free, name)
                if best_key is None or key < best_key:
                    best, best_key = name, key
        if best is None:
            self._full.add((pool, engine, gpus))
        return best

    def take(self, name: str, gpus: int) -> tuple[int, ...]:
        """Take `gpus` free GPUs of `name`: the lowest run of adjacent indices, else the lowest indices."""
        self.slots[name] -= 1
        if gpus == 0:
            return ()
        free = self.free[name]
        chosen = None
        for i in range(len(free) - gpus + 1):
            if free[i + gpus - 1] - free[i] == gpus - 1:
                # Adjacent indices usually share a PCIe switch or NVLink island,
                # and taking them keeps the other end of the machine in one piece.
                chosen = free[i:i + gpus]
                break
        if chosen is None:
            chosen = free[:gpus]
        taken = set(chosen)
        self.free[name] = [i for i in free if i not in taken]
        for group in self._member_of.get(name, ()):
            group.push(name, len(self.free[name]))
        return tuple(chosen)

    def _group(self, pool: str | None, engine: str) -> _Group:
        group = self._groups.get((pool, engine))
        if group is None:
            group = self._groups[(pool, engine)] = _Group()
            for name in self.in_pool(pool):
                node = self.nodes[name]
                if node.schedulable and engine in node.engines:
                    group.members.add(name)
                    group.push(name, len(self.free[name]))
                    self._member_of.setdefault(name, []).append(group)
        return group
