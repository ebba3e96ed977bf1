"""Why a replica could not be placed, in words an operator can act on, and whether waiting can help.

Each profile of the model gets one clause, best first, saying the first thing
that stands in its way, and whether it is *permanent* (this fleet can never
run it: only a change to the catalog or the fleet helps) or *transient* (no
room now; it can change by itself):

- permanent: no node has its pool; no node in the pool can run its engine
  (with the reason each agent gave, which names the fix), or, for an engine
  the catalog defines, no node's operator allows it (an agent names every
  catalog engine it allows in its report, so one it does not name is not
  allowed there: `llmgwctl agent --allow-engine NAME=PROGRAM`); the largest node
  has fewer GPUs than it needs; no GPU is big enough for its `gpu_memory`.
- transient: every node that could run it is unreachable or draining, or
  already runs MAX_REPLICAS_PER_NODE replicas, or (a profile with no GPU)
  as many CPU replicas as its agent allows; or too few free GPUs / too
  little free GPU memory now, with the numbers and who holds the GPUs (model
  and priority), so the operator sees what to move, stop or reprioritise.

A profile spanning nodes (a group of N members, `gang`) gets its own
clause: permanent when not even one member could ever land (the reasons
above), or when its pool has fewer than N nodes that could host a member
were they empty (reachable or not); transient otherwise, with how many
nodes have the room now, how many more are busy or unschedulable, and
who holds their GPUs.

The model is permanent only when every profile is. The text is computed from
the fleet as it is at the end of the pass, i.e. what the operator will find
once the plan is applied.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from ..catalog import EngineSpec, Model, Profile
from ..catalog.sizes import human_mib
from .fleet import MAX_REPLICAS_PER_NODE, Fleet
from .model import Assignment, Running

# Naming every node that lacks an engine would bury the point in a big pool;
# three names say which kind of node it is, the count says how many. The same
# for the models holding a pool's GPUs: the three biggest holders are the ones
# worth acting on.
NAMES_SHOWN = 3
class Explainer:
    """Builds reasons for one pass; clauses are cached because many replicas share a profile shape."""

    def __init__(self, fleet: Fleet, running: Sequence[Running] = (), priorities: Mapping[str, int] | None = None,
                 starts: Sequence[Assignment] = (), engines: Mapping[str, EngineSpec] = MappingProxyType({}),
                 reserved: Mapping[str, int] | None = None):
        self.fleet = fleet
        # GPUs preemption took from the fleet for a group (`Preemption.reserved`): free once the plan is applied.
        self.reserved = reserved or {}
        self.engines = engines          # the catalog's: which engines it defines itself, and what they run
        self.running = running
        self.starts = starts
        self.priorities = priorities or {}
        self._clauses: dict[tuple[str | None, str, int, int, int], tuple[str, bool]] = {}
        self._holders: dict[tuple[str | None, str], str] = {}
        self._by_node: dict[str, list[Running | Assignment]] | None = None
        self._fleet_reason: str | None = None
        self._fleet_checked = False

    def why(self, model: Model) -> tuple[str, bool]:
        """(the reason, whether it is permanent) for a replica of `model` that fits nowhere."""
        blocked = self._whole_fleet()
        if blocked is not None:
            return blocked, False           # agents may yet report, nodes come back
        clauses = [(p, self._clause(p)) for p in model.ranked()]
        text = "; ".join(f"{_title(p)}: {clause}" for p, (clause, _) in clauses)
        return text, all(permanent for _, (_, permanent) in clauses)

    def _whole_fleet(self) -> str | None:
        if not self._fleet_checked:
            self._fleet_checked = True
            nodes = self.fleet.nodes
            if not nodes:
                self._fleet_reason = "no node in the inventory (no agent has reported)"
            elif not any(n.schedulable for n in nodes.values()):
                self._fleet_reason = (f"no schedulable node ({_count(len(nodes), 'node')}, "
                                      "all unreachable or draining)")
        return self._fleet_reason

    def _clause(self, profile: Profile) -> tuple[str, bool]:
        return self._shape(profile.pool, profile.engine, profile.gpus, profile.gpu_memory_mib or 0, profile.nodes)

    def _shape(self, pool: str | None, engine: str, gpus: int, memory: int, nodes: int) -> tuple[str, bool]:
        key = (pool, engine, gpus, memory, nodes)
        clause = self._clauses.get(key)
        if clause is None:
            clause = self._clauses[key] = \
                self._explain(pool, engine, gpus, memory) if nodes == 1 else self._explain_group(pool, engine, gpus, nodes)
        return clause

    def _explain_group(self, pool: str | None, engine: str, gpus: int, nodes: int) -> tuple[str, bool]:
        """A group needs `nodes` distinct nodes with `gpus` whole free GPUs each: how many there are, and why not more."""
        each = f"spans {nodes} nodes with {_count(gpus, 'GPU')} each" if gpus else f"spans {nodes} nodes"
        one, permanent = self._shape(pool, engine, gpus, 0, 1)
        if permanent:                   # not even one member could ever be placed
            return f"{each}: {one}", True
        fleet = self.fleet
        where = f"pool {pool}" if pool is not None else "all pools"
        # Nodes that could host a member were they empty (reachable or not: one unreachable may come back).
        able = [n for n in fleet.in_pool(pool)
                if engine in fleet.nodes[n].engines and len(fleet.nodes[n].gpus) >= gpus]
        if len(able) < nodes:
            return (f"{each}: {where} has {_count(len(able), 'node')} that can run {engine} with "
                    f"{_count(gpus, 'GPU')}, so it can never be placed; add "
                    f"{_count(nodes - len(able), 'such node')} or lower the profile's nodes"), True
        up = [n for n in able if fleet.nodes[n].schedulable]
        fit = [n for n in up if self._free(n) >= gpus and fleet.slots[n] > 0
               and (gpus or fleet.cpu_room(n))]
        room = _count(gpus, 'free GPU') if gpus else "room for a replica without a GPU"
        text = f"{each}: {where} has {_count(len(fit), 'node')} with {room}"
        busy, down = len(up) - len(fit), len(able) - len(up)
        if busy or down:
            text += " (" + ", ".join(part for part in (
                f"{busy} more {'is' if busy == 1 else 'are'} busy" if busy else "",
                f"{down} {'is' if down == 1 else 'are'} unschedulable" if down else "") if part) + ")"
        text += f", needs {nodes}"
        holders = self._held_by(pool, engine, up)
        return (text + (f"; GPUs held by {holders}" if holders else "")), False

    def _explain(self, pool: str | None, engine: str, gpus: int, memory: int) -> tuple[str, bool]:
        fleet = self.fleet
        names = fleet.in_pool(pool)
        where = f"pool {pool}" if pool is not None else "all pools"
        inside = f" in pool {pool}" if pool is not None else ""
        if not names:
            return f"no node has pool {pool}, so it can never be placed; start an agent with --pool {pool}", True
        able = [n for n in names if engine in fleet.nodes[n].engines]
        schedulable = [n for n in names if fleet.nodes[n].schedulable]
        if not able:
            if not schedulable:
                return (f"no schedulable node in {where} ({_count(len(names), 'node')}, "
                        "all unreachable or draining)"), False
            if self._custom(engine) and all(engine not in fleet.nodes[n].unavailable for n in schedulable):
                return (f"no node{inside} allows catalog engine '{engine}': a node runs a catalog-defined engine "
                        f"only if its operator allows it ({self._allow_hint(engine)})"), True
            return f"no node{inside} can run engine {engine} ({self._lacking(schedulable, engine)})", True
        largest = max(len(fleet.nodes[n].gpus) for n in able)
        if largest < gpus:
            return (f"the largest node{inside} that runs {engine} has {_count(largest, 'GPU')}; this profile "
                    f"needs {gpus}, so it can never be placed"), True
        if memory and gpus:
            biggest = max(self._kth_total(n, gpus) for n in able)
            if biggest < memory:
                if biggest == 0:
                    return (f"no node{inside} reports the memory of {_count(gpus, 'GPU')}; this profile needs "
                            f"{human_mib(memory)} per GPU, so it can never be placed"), True
                return (f"the largest GPU{inside} has {human_mib(biggest)}; this profile needs "
                        f"{human_mib(memory)} per GPU, so it can never be placed"), True
        up = [n for n in able if fleet.nodes[n].schedulable]
        if not up:
            return (f"no schedulable node in {where} ({_count(len(able), 'node')}, "
                    "all unreachable or draining)"), False
        if all(fleet.slots[n] <= 0 for n in up):
            # Transient: a scale-down or a model leaving frees slots by itself.
            return (f"every node that can run it ({_count(len(up), 'node')}) already runs "
                    f"{MAX_REPLICAS_PER_NODE} replicas, the most one node runs"), False
        if gpus == 0 and all(fleet.slots[n] <= 0 or not fleet.cpu_room(n) for n in up):
            # Transient too: a CPU replica stopping, or the agent's limit raised.
            full = [n for n in up if not fleet.cpu_room(n)]
            shown = "; ".join(f"node {n}: {_count(fleet.nodes[n].cpu_replicas or 0, 'CPU replica')}, its limit"
                              for n in full[:NAMES_SHOWN])
            if len(full) > NAMES_SHOWN:
                shown += f"; {_count(len(full) - NAMES_SHOWN, 'more node')} likewise"
            return (f"every node that can run it ({_count(len(up), 'node')}) is full for replicas without a GPU "
                    f"({shown}); raise an agent's --max-cpu-replicas or add a node"), False
        if memory and gpus:
            best = max(fleet.kth_budget(n, gpus) for n in up)
            text = (f"{where}: the most free GPU memory is {human_mib(best)}"
                    + (f" on {gpus} GPUs of one node" if gpus > 1 else "")
                    + f"; needs {human_mib(memory)} per GPU")
        else:
            total = sum(len(fleet.nodes[n].gpus) for n in up)
            free = [self._free(n) for n in up]
            text = f"{where}: {sum(free)} of {_count(total, 'GPU')} free on {_count(len(up), 'node')}"
            if len(up) > 1:
                text += f", at most {max(free)} on one"
            text += f", needs {gpus}"
        holders = self._held_by(pool, engine, up)
        return (text + (f"; GPUs held by {holders}" if holders else "")), False

    def _free(self, name: str) -> int:
        return self.fleet.free_count(name) + self.reserved.get(name, 0)

    def _kth_total(self, name: str, gpus: int) -> int:
        node = self.fleet.nodes[name]
        totals = sorted((node.memory.get(i, (0, 0))[0] for i in node.gpus), reverse=True)
        return totals[gpus - 1] if len(totals) >= gpus else 0

    def _held_by(self, pool: str | None, engine: str, names: list[str]) -> str:
        """The models holding GPUs on these nodes, most GPUs first: "llama-70b (priority 10, 6 GPUs), ..."."""
        key = (pool, engine)
        if key not in self._holders:
            if self._by_node is None:
                self._by_node = defaultdict(list)
                holders: list[Running | Assignment] = [*self.running, *self.starts]
                for r in holders:
                    if r.gpu_indices:
                        self._by_node[r.node].append(r)
                for a in self.starts:       # a group's other members hold their nodes' GPUs too
                    for name, indices in a.members:
                        if indices:
                            self._by_node[name].append(Running("", a.model, a.profile, name, indices))
            # Who holds them once the plan is applied: existing replicas and this pass's starts.
            held: dict[str, set[tuple[str, int]]] = defaultdict(set)
            for name in names:
                for r in self._by_node.get(name, ()):
                    held[r.model].update((name, i) for i in r.gpu_indices)
            ranked = sorted(held.items(), key=lambda kv: (-len(kv[1]), kv[0]))
            parts = []
            for model, gpus in ranked[:NAMES_SHOWN]:
                prio = self.priorities.get(model)
                label = f"priority {prio}, " if prio is not None else "not in the catalog, "
                parts.append(f"{model} ({label}{_count(len(gpus), 'GPU')})")
            if len(ranked) > NAMES_SHOWN:
                parts.append(f"{_count(len(ranked) - NAMES_SHOWN, 'more model')}")
            self._holders[key] = ", ".join(parts)
        return self._holders[key]

    def _lacking(self, names: list[str], engine: str) -> str:
        """The nodes that lack `engine`, grouped by the reason their agents gave, since the reason says the fix."""
        by_reason: dict[str, list[str]] = {}
        # A node that does not name a catalog engine at all does not allow it.
        silent = f"not allowed there ({self._allow_hint(engine)})" if self._custom(engine) else ""
        for name in names:
            by_reason.setdefault(self.fleet.nodes[name].unavailable.get(engine, silent), []).append(name)
        parts = []
        for reason, group in list(by_reason.items())[:NAMES_SHOWN]:
            shown = ", ".join(group[:NAMES_SHOWN])
            if len(group) > NAMES_SHOWN:
                shown += f" and {len(group) - NAMES_SHOWN} more"
            parts.append(f"{shown} lack{'s' if len(group) == 1 else ''} it" + (f": {reason}" if reason else ""))
        if len(by_reason) > NAMES_SHOWN:
            rest = sum(len(g) for g in list(by_reason.values())[NAMES_SHOWN:])
            parts.append(f"{_count(rest, 'more node')} for other reasons")
        return "; ".join(parts)


    def _custom(self, engine: str) -> bool:
        spec = self.engines.get(engine)
        return spec is not None and not spec.builtin

    def _allow_hint(self, engine: str) -> str:
        command = self.engines[engine].command
        program = command[0] if command else ""
        # Only a plain program is worth suggesting: the hint is pasted into a shell.
        if not re.fullmatch(r"[A-Za-z0-9_./+-]{1,200}", program):
            program = "PROGRAM"
        return f"llmgwctl agent --allow-engine {engine}={program}"


def _title(profile: Profile) -> str:
    pool = f"pool {profile.pool}" if profile.pool is not None else "any pool"
    memory = f" x {human_mib(profile.gpu_memory_mib)}" if profile.gpu_memory_mib else ""
    return f"profile {profile.name} ({profile.engine}, {_count(profile.gpus, 'GPU')}{memory}, {pool})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
