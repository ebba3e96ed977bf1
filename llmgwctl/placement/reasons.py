"""Why a replica could not be placed, in words an operator can act on.

Each profile of the model gets one clause, best first, saying the first thing
that stands in its way: no node in its pool, no schedulable node there, no node
whose agent runs its engine (with the reason each agent gave, which names the
fix), or too few free GPUs (with the numbers). The text
is computed from the fleet as it is at the end of the pass, i.e. what the
operator will find once the plan is applied.
"""
from __future__ import annotations

from ..catalog import Model, Profile
from .fleet import MAX_REPLICAS_PER_NODE, Fleet

# Naming every node that lacks an engine would bury the point in a big pool;
# three names say which kind of node it is, the count says how many.
NAMES_SHOWN = 3


class Explainer:
    """Builds reasons for one pass; clauses are cached because many replicas share a profile shape."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self._clauses: dict[tuple[str | None, str, int], str] = {}
        self._fleet_reason: str | None = None
        self._fleet_checked = False

    def why(self, model: Model) -> str:
        blocked = self._whole_fleet()
        if blocked is not None:
            return blocked
        return "; ".join(f"{_title(p)}: {self._clause(p)}" for p in model.ranked())

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

    def _clause(self, profile: Profile) -> str:
        key = (profile.pool, profile.engine, profile.gpus)
        clause = self._clauses.get(key)
        if clause is None:
            clause = self._clauses[key] = self._explain(*key)
        return clause

    def _explain(self, pool: str | None, engine: str, gpus: int) -> str:
        fleet = self.fleet
        names = fleet.in_pool(pool)
        where = f"pool {pool}" if pool is not None else "all pools"
        if not names:
            return f"no node in pool {pool}"
        schedulable = [n for n in names if fleet.nodes[n].schedulable]
        if not schedulable:
            return f"no schedulable node in {where} ({_count(len(names), 'node')}, all unreachable or draining)"
        able = [n for n in schedulable if engine in fleet.nodes[n].engines]
        if not able:
            inside = f" in pool {pool}" if pool is not None else ""
            return f"no node{inside} can run engine {engine} ({self._lacking(schedulable, engine)})"
        if all(fleet.slots[n] <= 0 for n in able):
            return (f"every node that can run it ({_count(len(able), 'node')}) already runs "
                    f"{MAX_REPLICAS_PER_NODE} replicas, the most one node runs")
        total = sum(len(fleet.nodes[n].gpus) for n in able)
        free = [fleet.free_count(n) for n in able]
        text = f"{where}: {sum(free)} of {_count(total, 'GPU')} free on {_count(len(able), 'node')}"
        if len(able) > 1:
            text += f", at most {max(free)} on one"
        return text + f", needs {gpus}"


    def _lacking(self, names: list[str], engine: str) -> str:
        """The nodes that lack `engine`, grouped by the reason their agents gave, since the reason says the fix."""
        by_reason: dict[str, list[str]] = {}
        for name in names:
            by_reason.setdefault(self.fleet.nodes[name].unavailable.get(engine, ""), []).append(name)
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


def _title(profile: Profile) -> str:
    pool = f"pool {profile.pool}" if profile.pool is not None else "any pool"
    return f"profile {profile.name} ({profile.engine}, {_count(profile.gpus, 'GPU')}, {pool})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
