"""Which replica holds which LoRA adapter: the catalog's `adapters:` placed on their base's replicas.

Owns one rule, run every pass that could change its answer: each adapter of
a model goes on every replica of its base (`replicas: all`), or on N of them,
spread. A spread keeps the replicas that hold an adapter already (a move
would be an unload and a load for nothing), then adds the replicas holding
the fewest adapters, replica id breaking ties so every pass agrees. Replicas
on their way out (draining, stopping) and gone ones hold nothing new and
count for nothing: their replacements get the adapters.

An adapter written `replicas: {min, max}` has its N follow its own load:
the routers' in-flight counters per adapter (an `AdapterLoadSource`),
differenced pass to pass into its time-averaged requests in flight, handed
to an `autoscale.Autoscaler` of its own with the adapter's `autoscale`
policy -- the models' arithmetic, not a second one: holders =
ceil(load / target) between min and max (and never past the replicas the
base runs), nothing inside the tolerance band, fewer only after a whole
scale_down_window that needed fewer. A pass with no such adapter reads no
counter; one with them reads the counters once, and walks the records only
when a count moved, the catalog swapped or a record changed.

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
import time
from collections.abc import Callable, Iterable, Mapping

from ..catalog import Adapter, Catalog, Model, ScalingPolicy
from ..catalog.modelrules import LAUNCH_LORA_ENGINES
from ..contracts import AdapterLoadSource, AdapterSpec, AdapterSpread, ReplicaState
from .autoscale import Autoscaler, Signal
from .records import Records, Replica, is_worker
from .scaling import GONE

# Hold nothing new: on their way out, or on a node that stopped reporting
# (its adapters stay written, for when it comes back; a spread's count goes
# to the replicas that serve).
_OUT = frozenset(GONE) | {ReplicaState.LOST}


class _Spread:
    """One growing adapter's state: its policy's history, the holders it wants, the load that was decided on."""

    __slots__ = ("scaler", "policy", "wanted", "load")

    def __init__(self, policy: ScalingPolicy, floor: int):
        self.scaler = Autoscaler()
        self.policy = policy
        self.wanted = floor
        self.load: float | None = None


class AdapterPlacer:
    """Writes each record's placed adapters; `place()` is the one pass, cheap when nothing changed."""

    def __init__(self, records: Records, *, load: AdapterLoadSource | None = None,
                 clock: Callable[[], float] = time.monotonic, event: Callable[[str, str], None] = lambda k, m: None):
        self.records = records
        self.load = load
        self._clock = clock
        self._event = event
        self._catalog: Catalog | None = None
        # The catalog's adapters that grow with load, with their base (per catalog: found once a swap).
        self._growing: tuple[tuple[Model, Adapter], ...] = ()
        self._spreads: dict[str, _Spread] = {}
        self._read: tuple[float, dict[str, float]] | None = None     # the last pass's counters
        # As the last walk placed them: per base, the replicas that serve; per adapter, its holders.
        self._live: dict[str, int] = {}
        self._holders: dict[str, int] = {}

    def place(self, catalog: Catalog) -> None:
        """Place every adapter of `catalog`, if the catalog, a record or a growing adapter's count changed."""
        records = self.records
        swapped = catalog is not self._catalog
        if swapped:
            self._swap(catalog)
        moved = self._follow() if self._growing else False
        if not swapped and not moved and not records.changed_ids:
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
        self._live.clear()
        self._holders.clear()
        for name, recs in by_model.items():
            model = catalog.resolve(name)
            self._place_model(model, recs)

    def _swap(self, catalog: Catalog) -> None:
        """A new catalog: its growing adapters found. A spread keeps its holders within its new bounds;
        one whose policy changed forgets its history, so a shrink waits a whole window of the new policy."""
        self._growing = tuple((m, a) for m in catalog.models if m.lora_slots for a in m.adapters if a.grows)
        spreads = {}
        for _, adapter in self._growing:
            policy = adapter.autoscale.policy()
            old = self._spreads.get(adapter.name)
            floor, ceiling = adapter.replicas or 0, adapter.max_replicas or 0
            spread = old if old is not None and old.policy == policy else _Spread(policy, floor)
            if old is not None:
                spread.wanted = max(floor, min(ceiling, old.wanted))
            spreads[adapter.name] = spread
        self._spreads = spreads
        if not spreads:
            self._read = None

    def _follow(self) -> bool:
        """Each growing adapter's wanted holders after this pass's load; True when any count moved."""
        now = self._clock()
        counters = dict(self.load.adapter_inflight_seconds()) if self.load is not None else {}
        before, self._read = self._read, (now, counters)
        moved = False
        for model, adapter in self._growing:
            spread = self._spreads[adapter.name]
            floor, ceiling = adapter.replicas or 0, adapter.max_replicas or 0
            live = self._live.get(model.name)
            high = max(floor, ceiling if live is None else min(ceiling, live))
            current = max(floor, min(high, spread.wanted))
            sig = _signal(adapter.name, counters, before, now, current)
            d = spread.scaler.decide(spread.policy, now, current, sig, floor, high)
            if d.load is not None:
                spread.load = d.load
            if d.wanted != spread.wanted:
                if d.reason:
                    verb = "spread to" if d.wanted > spread.wanted else "back to"
                    self._event("adapter-spread", f"adapter {adapter.name} of {model.name}: {verb} {d.wanted} "
                                f"replica{'s' if d.wanted != 1 else ''}: {d.reason}")
                spread.wanted = d.wanted
                moved = True
        return moved

    def spreads(self, model: Model) -> tuple[AdapterSpread, ...]:
        """Each adapter of `model` as the last walk placed it, for status."""
        live = self._live.get(model.name, 0)
        out = []
        for adapter in model.adapters:
            spread = self._spreads.get(adapter.name) if adapter.grows else None
            out.append(AdapterSpread(
                adapter.name, self._holders.get(adapter.name, 0), live, adapter.replicas,
                adapter.max_replicas if adapter.grows else adapter.replicas,
                spread.load if spread is not None else None,
                spread.policy.target if spread is not None else None))
        return tuple(out)

    def _count(self, adapter: Adapter) -> int | None:
        """Holders `adapter` wants now: its floor, or what its load spread it to; None: every replica."""
        spread = self._spreads.get(adapter.name) if adapter.grows else None
        return spread.wanted if spread is not None else adapter.replicas

    def _place_model(self, model: Model | None, recs: list[Replica]) -> None:
        live = sorted((r for r in recs if r.state not in _OUT), key=lambda r: r.spec.id)
        want: dict[str, list[AdapterSpec]] = {r.spec.id: [] for r in live}
        count = dict.fromkeys(want, 0)
        if model is not None:
            self._live[model.name] = len(live)
        for adapter in (model.adapters if model is not None and model.lora_slots else ()):
            spec = AdapterSpec(adapter.name, adapter.source)
            n = self._count(adapter)
            if n is None or n >= len(live):
                chosen: Iterable[Replica] = live
            else:
                holders = [r for r in live if any(a.name == adapter.name for a in r.spec.adapters)]
                # Ready holders first: a replica still starting keeps it only if there is room.
                holders.sort(key=lambda r: (r.state is not ReplicaState.READY, r.spec.id))
                chosen = holders[:n]
                picked = {r.spec.id for r in chosen}
                rest = sorted((r for r in live if r.spec.id not in picked), key=lambda r: (count[r.spec.id], r.spec.id))
                chosen = list(chosen) + rest[:n - len(picked)]
            held = 0
            for r in chosen:
                want[r.spec.id].append(spec)
                count[r.spec.id] += 1
                held += 1
            self._holders[adapter.name] = held
        for r in recs:
            adapters = tuple(want.get(r.spec.id, ())) if r.state not in _OUT else r.spec.adapters
            if adapters != r.spec.adapters:
                r.spec = dataclasses.replace(r.spec, adapters=adapters)


def _signal(name: str, counters: Mapping[str, float], before: tuple[float, Mapping[str, float]] | None,
            now: float, holders: int) -> Signal:
    """An adapter's time-averaged requests in flight since the last pass; no load without two readings.

    A counter that went down (its router restarted, the adapter left the
    catalog and came back) is a reset: this pass has no reading, and the next
    differences from it.
    """
    if before is None or now <= before[0]:
        return Signal(None, holders)
    then, old = before
    grown = counters.get(name, 0.0) - old.get(name, 0.0)
    if grown < 0:
        return Signal(None, holders)
    return Signal(grown / (now - then), holders, span=now - then)
