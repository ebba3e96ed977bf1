"""Which replica holds which LoRA adapter: the catalog's `adapters:` placed on their base's replicas.

Owns one rule, run every pass that could change its answer: each adapter of
a model goes on every replica of its base (`replicas: all`), or on N of them,
spread. A spread keeps the replicas that hold an adapter already (a move
would be an unload and a load for nothing), then adds the replicas holding
the fewest adapters, replica id breaking ties so every pass agrees. Replicas
on their way out (draining, stopping) and gone ones hold nothing new and
count for nothing: their replacements get the adapters.

The answer is written into each record's spec (`ReplicaSpec.adapters`),
outside its hash, so the node's desired list changes and its agent loads or
unloads without restarting the engine (agent/adapters.py). A replica of an
engine that loads adapters only at launch (llama.cpp) is left alone: its
spec got every adapter of its model when it was made, in its hash, so an
adapter edit makes it stale and placement replaces it, surge first. The router's
endpoint lists an adapter only where it is both placed and reported loaded
(publishing.py), so traffic leaves a replica before its adapter is unloaded.
It must not know how adapters are loaded or routed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..catalog import Catalog, Model
from ..catalog.modelrules import LAUNCH_LORA_ENGINES
from ..contracts import AdapterSpec, ReplicaState
from .records import Records, Replica, is_worker
from .scaling import GONE

# Hold nothing new: on their way out, or on a node that stopped reporting
# (its adapters stay written, for when it comes back; a spread's count goes
# to the replicas that serve).
_OUT = frozenset(GONE) | {ReplicaState.LOST}


class AdapterPlacer:
    """Writes each record's placed adapters; `place()` is the one pass, cheap when nothing changed."""

    def __init__(self, records: Records):
        self.records = records
        self._catalog: Catalog | None = None

    def place(self, catalog: Catalog) -> None:
        """Place every adapter of `catalog`, if the catalog or any record changed since the last call."""
        records = self.records
        if catalog is self._catalog and not records.changed_ids:
            return
        # The first call walks whatever the catalog says: adopted replicas may
        # hold adapters a catalog edited while the controller was down dropped.
        had = self._catalog is None or self._catalog.has_adapters
        self._catalog = catalog
        if not catalog.has_adapters and not had:
            return
        by_model: dict[str, list[Replica]] = {}
        for rec in records.values():
            # A group's adapters are its head's to load: it serves the API. A
            # launch-time engine's are its spec's for life.
            if not is_worker(rec.spec) and rec.spec.engine not in LAUNCH_LORA_ENGINES:
                by_model.setdefault(rec.spec.model, []).append(rec)
        for name, recs in by_model.items():
            model = catalog.resolve(name)
            self._place_model(model, recs)

    def _place_model(self, model: Model | None, recs: list[Replica]) -> None:
        live = sorted((r for r in recs if r.state not in _OUT), key=lambda r: r.spec.id)
        want: dict[str, list[AdapterSpec]] = {r.spec.id: [] for r in live}
        count = dict.fromkeys(want, 0)
        for adapter in (model.adapters if model is not None and model.lora_slots else ()):
            spec = AdapterSpec(adapter.name, adapter.source)
            if adapter.replicas is None or adapter.replicas >= len(live):
                chosen: Iterable[Replica] = live
            else:
                holders = [r for r in live if any(a.name == adapter.name for a in r.spec.adapters)]
                # Ready holders first: a replica still starting keeps it only if there is room.
                holders.sort(key=lambda r: (r.state is not ReplicaState.READY, r.spec.id))
                chosen = holders[:adapter.replicas]
                picked = {r.spec.id for r in chosen}
                rest = sorted((r for r in live if r.spec.id not in picked), key=lambda r: (count[r.spec.id], r.spec.id))
                chosen = list(chosen) + rest[:adapter.replicas - len(picked)]
            for r in chosen:
                want[r.spec.id].append(spec)
                count[r.spec.id] += 1
        for r in recs:
            adapters = tuple(want.get(r.spec.id, ())) if r.state not in _OUT else r.spec.adapters
            if adapters != r.spec.adapters:
                r.spec = dataclasses.replace(r.spec, adapters=adapters)
