"""Free GPUs and free GPU memory per node during one placement pass, indexed so picking a node does not scan the fleet.

One `Fleet` lives for one call of `place()`. It starts from the inventory
and what every existing replica holds there (its GPUs, or its share of a GPU's
memory), one `Held` per node, and then only ever takes more: nothing is freed
inside a pass (a replica being stopped keeps its GPUs until it is gone, and the
next pass sees the room). That monotonicity is what keeps the indexes cheap
and exact. A `Held` is never changed once built (the fleet copies a node's
maps before its first take there), so place() can reuse one for the next
pass while that node's GPUs and replicas are the same (`place.Memo`).

A GPU is in one of three conditions:

- *whole-free*: nobody holds it. A profile without `gpu_memory` takes whole
  GPUs only, as it always did, and only whole-free ones.
- *shared*: replicas of profiles with `gpu_memory` hold parts of its memory.
  Its **budget** is what a further such replica may still take:
  `min(total - declared, reported free - declared by replicas not ready)`.
  The reported free memory already excludes what ready replicas allocated
  and what anything outside llmgw holds; a replica not yet ready (starting,
  or placed this pass) may not have allocated yet, so its need is taken off
  the free figure too. Counting a starting replica that did allocate twice
  only errs towards not sharing, never towards overcommitting a GPU.
- *held whole*: a replica without `gpu_memory` has it; its budget is 0.

A whole-free GPU is also open to memory profiles (its budget is its free
memory). Memory profiles are packed best-fit, onto the GPU with the least
budget that still fits, so whole GPUs stay whole for the profiles that need
them. A GPU whose agent reports no memory (0) is never shared: a memory
profile cannot be checked against it.

The indexes:

- Nodes that could run a profile form a *group* keyed by (pool, engine). A group
  is built the first time a profile asks for it, so a pass that places nothing
  (the no-op pass, the common case) builds none.
- Inside a group, nodes sit in buckets by whole-free GPU count, each bucket a
  heap of node names. Best-fit is "the first bucket at or above the profile's
  GPU count that has a usable node"; the heap gives the lowest name for
  determinism. When a node's count drops it is pushed into its new bucket; the
  entry in the old bucket is dropped lazily when it reaches the top (its count
  no longer matches). Counts only fall, so an entry is never duplicated.
- For memory profiles spanning `g` GPUs, a group keeps a sorted list of
  (the node's g-th largest budget, node name), built the first time such a
  profile asks; a node fits a need of `m` per GPU when that key is >= m, so
  the first usable entry at or after `m` is the best fit. Budgets only fall,
  so stale entries (key no longer the node's) are dropped when met.
- A node also has a number of replica slots (MAX_REPLICAS_PER_NODE less what
  it runs), which only fall too; a node out of slots leaves every bucket and
  memory index the same lazy way. A node whose agent reports a CPU capacity
  has CPU slots too (its `cpu_replicas` less the GPU-less replicas it runs):
  GPU-less profiles pick from groups of their own (the same nodes, their own
  buckets), which a node out of CPU slots leaves the same lazy way, while
  it stays in the groups GPU profiles pick from.
- If a (pool, engine, gpus, memory) asked for finds no node, no later request
  in the pass can find one either; it is remembered as full.
- Nodes already running the model being placed are *parked*: taken out of
  the bucket heaps and memory indexes when a pick meets them, and kept aside
  while the picks are for that same model. Spread only grows during a pass,
  so a parked node stays one the model skips; without parking, every pick of
  a model with many replicas walked past all of its own nodes again (1,000
  replicas of one model: ~500,000 heap operations). When a pick is for
  another model, the parked nodes it does not run on go back first (see
  `Fleet._park_for`).

- A group spanning nodes needs N distinct nodes at once (`pick_apart`):
  the same buckets are walked for the N best nodes, which go back
  untaken, so the caller takes all N or none.

It knows nodes, GPU counts and memory, nothing about models beyond the
per-node replica counts the caller passes in for spreading.
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping, Sequence

from .model import NodeView, Running, serving

# The most replicas one node runs, whatever their GPUs. Each replica is an
# engine process on a port of its own, and an agent's default port range
# (20000-20999) holds 1000; without a cap, profiles needing no GPU fit any node
# without end, and a catalog at its bounds (100,000 replicas) would pile them
# all on a few CPU nodes -- records the reconciler walks on every pass for
# engines that could never start. With it, a pass's work follows the fleet.
MAX_REPLICAS_PER_NODE = 1000


class _Group:
    """The schedulable nodes of one pool (or all pools) whose agents run one engine."""

    __slots__ = ("cpu", "members", "buckets", "counts", "by_memory", "parked_for", "parked_whole", "parked_memory")

    def __init__(self, cpu: bool = False) -> None:
        self.cpu = cpu          # the group GPU-less profiles pick from: CPU slots count too
        self.members: set[str] = set()
        self.buckets: dict[int, list[str]] = {}   # whole-free GPUs -> heap of node names
        self.counts: list[int] = []                # sorted keys of `buckets`
        self.by_memory: dict[int, list[tuple[int, str]]] = {}   # g -> sorted (g-th largest budget, node)
        # The spread (one model's replicas per node) whose nodes are parked, and
        # the entries taken out for it: (bucket, node) and (g, key, node).
        self.parked_for: Mapping[str, int] | None = None
        self.parked_whole: list[tuple[int, str]] = []
        self.parked_memory: list[tuple[int, int, str]] = []

    def push(self, name: str, free: int) -> None:
        heap = self.buckets.get(free)
        if heap is None:
            heap = self.buckets[free] = []
            bisect.insort(self.counts, free)
        heapq.heappush(heap, name)


class Held:
    """What the existing replicas on one node hold, built from exactly `gpus` and `replicas` and never changed after.

    Every replica keeps its GPUs whatever its state: its declared MiB per GPU
    (a memory profile), or the GPUs whole. A replica that is not serving may
    not have allocated yet, so its MiB are also `pending`: the reported free
    figure does not show them taken (see the module docstring).
    """

    __slots__ = ("gpus", "replicas", "free", "needs", "pending", "whole", "cpu")

    def __init__(self, gpus: tuple[int, ...], replicas: Sequence[Running]):
        self.gpus, self.replicas = gpus, replicas
        self.needs: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.whole: set[int] = set()
        taken: set[int] = set()
        self.cpu = 0            # replicas holding no GPU: what counts against the node's CPU limit
        for r in replicas:
            if not r.gpu_indices:
                self.cpu += 1
            taken.update(r.gpu_indices)
            if not r.memory_mib:
                self.whole.update(r.gpu_indices)
                continue
            for index in r.gpu_indices:
                self.needs[index] = self.needs.get(index, 0) + r.memory_mib
                if not serving(r):
                    self.pending[index] = self.pending.get(index, 0) + r.memory_mib
        self.free: list[int] = sorted(set(gpus) - taken)


class Fleet:
    def __init__(self, nodes: Sequence[NodeView], held: Mapping[str, Held] | None = None):
        """`held`: for every node, what the existing replicas hold there, built from its GPUs (None: nothing held)."""
        self.nodes: dict[str, NodeView] = {}
        for node in nodes:
            if node.name in self.nodes:
                raise ValueError(f"node {node.name!r} appears twice in the inventory given to placement")
            self.nodes[node.name] = node
        if held is None:
            held = {n.name: Held(n.gpus, ()) for n in nodes}
        own = {name: held[name] for name in self.nodes}
        self.free: dict[str, list[int]] = {name: h.free for name, h in own.items()}
        # Replicas each node may still take (MAX_REPLICAS_PER_NODE less what runs
        # there); like free GPUs, it only falls during a pass.
        self.slots: dict[str, int] = {name: MAX_REPLICAS_PER_NODE - len(h.replicas) for name, h in own.items()}
        # CPU replicas each node may still take, for nodes that report a limit:
        # the limit less the replicas holding no GPU there. Only falls too.
        self.cpu_slots: dict[str, int] = {}
        for name, h in own.items():
            limit = self.nodes[name].cpu_replicas
            if limit is not None:
                self.cpu_slots[name] = limit - h.cpu
        # What existing replicas hold, so preemption can tell this pass's
        # starts, which nothing frees, from replicas that may leave: GPU index ->
        # declared MiB (memory profiles), and the indices held whole. Only nodes
        # that have some. Shared with the `Held`s: read, never changed.
        self.base_needs: dict[str, dict[int, int]] = {name: h.needs for name, h in own.items() if h.needs}
        self.base_whole: dict[str, set[int]] = {name: h.whole for name, h in own.items() if h.whole}
        # The same once this pass's starts are added by take(), which copies a
        # node's map before changing it.
        self.needs: dict[str, dict[int, int]] = dict(self.base_needs)
        self.pending: dict[str, dict[int, int]] = {   # the part of `needs` not yet seen allocated
            name: h.pending for name, h in own.items() if h.pending}
        self.whole: dict[str, set[int]] = dict(self.base_whole)
        self._budgets: dict[str, dict[int, int]] = {}     # computed per node on first use
        self._by_pool: dict[str, list[str]] | None = None
        self._groups: dict[tuple[str | None, str, bool], _Group] = {}
        self._member_of: dict[str, list[_Group]] = {}
        self._full: set[tuple[str | None, str, int, int]] = set()

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

    def cpu_room(self, name: str) -> bool:
        """Whether the node may take one more replica without a GPU (always, when its agent reports no limit)."""
        return self.cpu_slots.get(name, 1) > 0

    def _room(self, name: str, group: _Group) -> bool:
        return self.slots[name] > 0 and (not group.cpu or self.cpu_slots.get(name, 1) > 0)

    def can_host(self, name: str, pool: str | None, engine: str) -> bool:
        """Could `name` ever run a profile of this pool and engine (ignoring free GPUs)?"""
        node = self.nodes.get(name)
        return (node is not None and node.schedulable and engine in node.engines
                and (pool is None or pool in node.pools))

    def budgets(self, name: str) -> dict[int, int]:
        """GPU index -> MiB a memory profile may still take there (0: none), for every GPU of the node."""
        budget = self._budgets.get(name)
        if budget is None:
            node = self.nodes[name]
            needs, whole = self.needs.get(name, {}), self.whole.get(name, ())
            pending = self.pending.get(name, {})
            budget = {}
            for index in node.gpus:
                total, free = node.memory.get(index, (0, 0))
                if total <= 0 or index in whole:
                    budget[index] = 0
                else:
                    budget[index] = max(0, min(total - needs.get(index, 0), free - pending.get(index, 0)))
            self._budgets[name] = budget
        return budget

    def kth_budget(self, name: str, gpus: int) -> int:
        """The `gpus`-th largest budget on the node: a memory need up to this fits on `gpus` of its GPUs."""
        values = sorted(self.budgets(name).values(), reverse=True)
        return values[gpus - 1] if len(values) >= gpus else 0

    # -- changing ---------------------------------------------------------

    def pick(self, pool: str | None, engine: str, gpus: int, spread: Mapping[str, int],
             memory_mib: int = 0) -> str | None:
        """The node for one more replica, or None when no node of this kind has room.

        Spread first: a node without a replica of the model (`spread` maps node
        name -> that model's replicas there) beats any node with one. Then
        best-fit: the fewest free GPUs (or the least memory budget) that still
        fit, so whole machines stay free for the models that need them. Then
        the name, for determinism. Calls passing the same `spread` mapping
        must only ever add to it (as place() does, one per model): nodes it
        names are kept aside for it between those calls (`_park_for`).
        """
        if (pool, engine, gpus, memory_mib) in self._full:
            return None
        group = self._group(pool, engine, cpu=gpus == 0)
        found = self._pick_memory(group, gpus, memory_mib, spread) if memory_mib and gpus else \
            self._pick_whole(group, gpus, spread)
        if found is not None:
            return found
        # Every node that fits already runs this model: fewest of its replicas, then best-fit.
        best, best_key = None, None
        for name, count in spread.items():
            if not count or name not in group.members or not self._room(name, group):
                continue
            room = self.kth_budget(name, gpus) if memory_mib and gpus else len(self.free.get(name, ()))
            if room >= (memory_mib if memory_mib and gpus else gpus):
                key = (count, room, name)
                if best_key is None or key < best_key:
                    best, best_key = name, key
        if best is None:
            self._full.add((pool, engine, gpus, memory_mib))
        return best

    def pick_apart(self, pool: str | None, engine: str, gpus: int, count: int,
                   spread: Mapping[str, int]) -> list[str] | None:
        """`count` distinct nodes with `gpus` whole free GPUs each, best first, or None when fewer have room; takes nothing.

        For the members of one group (`gang`): nodes in the order pick() would
        choose them were each taken in turn -- those not in `spread` first,
        best-fit, then the name; then those running the model, fewest of its
        replicas first. The entries it looks at go back into their buckets,
        so nothing changes but stale entries dropped, as pick() drops them.
        Fewer than `count` nodes with room stays so for the pass (room only
        shrinks), and is remembered like a full shape.
        """
        full = (pool, engine, gpus, -count)     # no memory profile spans nodes: a negative "memory" keys groups
        if full in self._full or (pool, engine, gpus, 0) in self._full:
            return None
        group = self._group(pool, engine, cpu=gpus == 0)
        self._park_for(group, spread)
        chosen: list[tuple[int, str]] = []
        for free in group.counts[bisect.bisect_left(group.counts, gpus):]:
            heap = group.buckets[free]
            while heap and len(chosen) < count:
                name = heapq.heappop(heap)
                if len(self.free[name]) != free or not self._room(name, group):
                    continue                   # it moved to a smaller bucket, or is full for this pass
                if spread.get(name):
                    group.parked_whole.append((free, name))   # runs the model: aside, as _pick_whole does
                else:
                    chosen.append((free, name))
            if len(chosen) == count:
                break
        for free, name in chosen:
            heapq.heappush(group.buckets[free], name)
        names = [name for _, name in chosen]
        if len(names) < count:
            taken = set(names)
            running = sorted((n, len(self.free[name]), name) for name, n in spread.items()
                             if n and name in group.members and name not in taken and self._room(name, group)
                             and len(self.free[name]) >= gpus)
            names += [name for _, _, name in running[:count - len(names)]]
        if len(names) < count:
            self._full.add(full)
            return None
        return names

    def _pick_whole(self, group: _Group, gpus: int, spread: Mapping[str, int]) -> str | None:
        self._park_for(group, spread)
        parked = group.parked_whole
        for free in group.counts[bisect.bisect_left(group.counts, gpus):]:
            heap = group.buckets[free]
            while heap:
                name = heap[0]
                if len(self.free[name]) != free or not self._room(name, group):
                    heapq.heappop(heap)        # it moved to a smaller bucket, or is full for this pass
                elif spread.get(name):
                    parked.append((free, heapq.heappop(heap)))   # runs the model already: aside until another model picks
                else:
                    return name
        return None

    def _pick_memory(self, group: _Group, gpus: int, memory_mib: int, spread: Mapping[str, int]) -> str | None:
        index = self._memory_index(group, gpus)
        self._park_for(group, spread)
        i = bisect.bisect_left(index, (memory_mib, ""))
        while i < len(index):
            key, name = index[i]
            if self.slots[name] <= 0:
                del index[i]                   # full for this pass; slots never come back
            elif self.kth_budget(name, gpus) != key:
                del index[i]                   # its budget fell; its current entry is further left
            elif spread.get(name):
                del index[i]                   # runs the model already: aside until another model picks
                group.parked_memory.append((gpus, key, name))
            else:
                return name
        return None

    def _park_for(self, group: _Group, spread: Mapping[str, int]) -> None:
        """Make the group's parked entries those of `spread`: another model's go back first, unless `spread` holds them too.

        Keyed by the spread mapping itself: place() keeps one per model for
        the whole pass and only ever adds to it, so an entry parked for it is
        still one its picks skip. Another model may want those nodes, so on a
        switch they go back -- all but those the new model runs on as well,
        which its picks would only park again. place() goes round-robin over
        the models short at one priority, so two models short of many switch
        on every pick; they mostly pack onto the same nodes (best-fit), and
        keeping those parked makes a switch one lookup per parked node where
        a pick used to cost a heap pop and push each. When one model is short
        of many (a rolling change, a scale-up), the others are done after
        their first rounds and its picks run back to back, each parking only
        the node the one before it took. Entries gone stale while parked (the
        count or budget fell, the slots ran out) are dropped, not put back:
        the node's current entry is already elsewhere, or it has no room.
        """
        if group.parked_for is spread:
            return
        whole: list[tuple[int, str]] = []
        for entry in group.parked_whole:
            count, name = entry
            if spread.get(name):
                whole.append(entry)
            elif len(self.free[name]) == count and self._room(name, group):
                heapq.heappush(group.buckets[count], name)
        memory: list[tuple[int, int, str]] = []
        for item in group.parked_memory:
            gpus, key, name = item
            if spread.get(name):
                memory.append(item)
            elif self.slots[name] > 0 and self.kth_budget(name, gpus) == key:
                bisect.insort(group.by_memory[gpus], (key, name))
        group.parked_whole, group.parked_memory, group.parked_for = whole, memory, spread

    def take(self, name: str, gpus: int, memory_mib: int = 0, indices: Sequence[int] | None = None) -> tuple[int, ...]:
        """Take room for one replica on `name` and return its GPU indices.

        Whole GPUs: the lowest run of adjacent indices, else the lowest indices
        (or exactly `indices`, free ones, where preemption keeps room for a group).
        Memory: the GPUs with the least budget that still fits, lowest index first.
        """
        self.slots[name] -= 1
        if gpus == 0:
            if name in self.cpu_slots:
                self.cpu_slots[name] -= 1
            return ()
        free = self.free[name]
        widths = {g for group in self._member_of.get(name, ()) for g in group.by_memory}
        before = {g: self.kth_budget(name, g) for g in widths}
        if memory_mib:
            budget = self.budgets(name)
            fitting = sorted((b, i) for i, b in budget.items() if b >= memory_mib)
            chosen = sorted(i for _, i in fitting[:gpus])
            # Copies: the maps may be a `Held`'s, which the next pass reuses.
            needs = self.needs[name] = dict(self.needs.get(name, {}))
            pending = self.pending[name] = dict(self.pending.get(name, {}))
            for i in chosen:
                budget[i] -= memory_mib
                needs[i] = needs.get(i, 0) + memory_mib
                pending[i] = pending.get(i, 0) + memory_mib
        else:
            # The lowest indices unless a run of adjacent ones is free below them:
            # adjacent indices usually share a PCIe switch or NVLink island, and
            # taking them keeps the other end of the machine in one piece.
            chosen = free[:gpus] if indices is None else sorted(indices)
            for i in range(len(free) - gpus + 1 if indices is None else 0):
                if free[i + gpus - 1] - free[i] == gpus - 1:
                    chosen = free[i:i + gpus]
                    break
            self.whole[name] = self.whole.get(name, set()) | set(chosen)   # a copy, as above
            if name in self._budgets:
                for i in chosen:
                    self._budgets[name][i] = 0
        taken = set(chosen)
        self.free[name] = [i for i in free if i not in taken]
        after = {g: self.kth_budget(name, g) for g in widths}
        moved = len(self.free[name]) != len(free)
        for group in self._member_of.get(name, ()):
            if moved:
                group.push(name, len(self.free[name]))
            for g, index in group.by_memory.items():
                if after[g] != before[g] and after[g] > 0:
                    bisect.insort(index, (after[g], name))
        return tuple(chosen)

    def _group(self, pool: str | None, engine: str, cpu: bool = False) -> _Group:
        group = self._groups.get((pool, engine, cpu))
        if group is None:
            group = self._groups[(pool, engine, cpu)] = _Group(cpu)
            for name in self.in_pool(pool):
                node = self.nodes[name]
                if node.schedulable and engine in node.engines:
                    group.members.add(name)
                    group.push(name, len(self.free[name]))
                    self._member_of.setdefault(name, []).append(group)
        return group

    def _memory_index(self, group: _Group, gpus: int) -> list[tuple[int, str]]:
        index = group.by_memory.get(gpus)
        if index is None:
            # Nodes with nothing to share (no memory reported, all held whole) stay out of it.
            index = group.by_memory[gpus] = sorted(
                (key, name) for name in group.members if (key := self.kth_budget(name, gpus)) > 0)
        return index
