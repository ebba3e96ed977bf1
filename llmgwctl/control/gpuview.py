"""The GPU view: per node, each GPU's memory, and who holds how much of it, from the agents' reports.

    GET /api/v1/gpus[?node=PREFIX][&offset=N][&limit=N]
        {"total": N, "offset": N, "nodes": [
           {"name", "state", "gpus": [
              {"index", "name", "memory_mib",          # total; 0: unknown
               "free_mib",                              # what its agent reports free (null: not reported)
               "replicas": [{"id", "model", "state", "memory_mib", "whole"}],
               "other_mib"}]}]}                         # held by nothing llmgw placed (null: unknown)

A replica with a memory share (`gpu_memory_mib` in its profile) holds that
much; one without holds the GPU whole (`whole`: true, `memory_mib` the
GPU's), as vLLM and SGLang take a fraction of all of it. `other_mib` is
what the agent found in use when it read the GPU, less the shares: another
program's, or a replica adopted at the agent's start.

Paged (at most MAX_LIMIT nodes an answer), so a page at 5,000 nodes reads a screenful, not the fleet;
and only the page's nodes' records are looked at (`Records.of`, the per-node index), not every replica:
each open console asks every few seconds.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..contracts import ReplicaState
from ..inventory import Node
from ..reconciler.records import Records, Replica

DEFAULT_LIMIT, MAX_LIMIT = 50, 200
# Replicas that hold no memory any more.
_GONE = {ReplicaState.STOPPING, ReplicaState.FAILED, ReplicaState.LOST}


def gpu_view(nodes: Iterable[Node], records: Records, *, prefix: str = "", offset: int = 0,
             limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    chosen = sorted((n for n in nodes if n.name.startswith(prefix) and n.gpus), key=lambda n: n.name)
    page = chosen[max(0, offset):max(0, offset) + max(0, min(limit, MAX_LIMIT))]
    on: dict[tuple[str, int], list[Replica]] = {}
    for rec in (rec for n in page for _, rec in records.of(n.name)):
        if rec.state not in _GONE:
            indices = rec.reported.gpu_indices if rec.reported is not None and rec.reported.gpu_indices \
                else rec.spec.gpu_indices
            for i in indices:
                on.setdefault((rec.node, i), []).append(rec)
    out = []
    for n in page:
        gpus = []
        for g in sorted(n.gpus, key=lambda g: g.index):
            holders = sorted(on.get((n.name, g.index), ()), key=lambda r: r.spec.id)
            rows = [{"id": r.spec.id, "model": r.spec.model, "state": r.state.value,
                     "memory_mib": r.spec.gpu_memory_mib or g.memory_mib, "whole": not r.spec.gpu_memory_mib}
                    for r in holders]
            shares = sum(r.spec.gpu_memory_mib for r in holders if r.spec.gpu_memory_mib)
            other = None
            if g.memory_free_mib is not None and g.memory_mib:
                other = max(0, g.memory_mib - g.memory_free_mib - shares)
            gpus.append({"index": g.index, "name": g.name, "memory_mib": g.memory_mib, "free_mib": g.memory_free_mib,
                         "replicas": rows, "other_mib": other})
        out.append({"name": n.name, "state": "ready" if n.reachable else "unreachable", "gpus": gpus})
    return {"total": len(chosen), "offset": offset, "nodes": out}
