"""How many replicas each model wants this pass: its floor and ceiling, idle timeout, wakes, and its autoscaling policy.

`Scaling` owns each model's scale state (`ModelScale`: what it wants, when it
was last used or woken, its autoscaler's history, its cold start) and the
per-pass readings the policies scale on: the engines' gauges and the routers'
in-flight counters, differenced with the last pass's. The policy itself is in
`autoscale`; this is what feeds it and what keeps its answers.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ..catalog import Autoscale, Catalog, Model, ScalingPolicy
from ..contracts import ConcurrencySource, LoadReading, LoadSource, ReplicaState, UsageSnapshot
from ..contracts.usage import UNUSED
from .autoscale import Autoscaler, signal
from .records import Records, Replica

# What a model's scale leaves out (on their way out) and counts as on their way in.
GONE = (ReplicaState.DRAINING, ReplicaState.STOPPING)
COMING = (ReplicaState.PENDING, ReplicaState.STARTING)


@dataclass
class ModelScale:
    wanted: int = 0
    last_used: float | None = None
    woken: float | None = None
    # The autoscaling policy's state and its last measurement, for status.
    autoscaler: Autoscaler = field(default_factory=Autoscaler)
    policy: ScalingPolicy | None = None    # the catalog policy the history was gathered under
    policy_of: Autoscale | None = None     # the catalog block `policy` was resolved from (see Scaling.wanted)
    load: float | None = None
    needed: int | None = None
    # Seconds from placement to ready of its recent replicas (a running mean): how far ahead a step
    # up is sized (autoscale.Autoscaler.decide); 0 until one of its replicas was placed and became ready.
    cold_start: float = 0.0


class Tally:
    """One model's records as one pass of `Scaling.wanted` sees them (see `Scaling.tally`)."""

    __slots__ = ("ready", "starting", "last_used", "grown", "span")

    def __init__(self, last_used: float | None, span: float | None):
        self.ready: list[str] = []      # ids of its ready replicas, in record order
        self.starting = 0               # placed or starting: capacity on its way
        self.last_used = last_used      # its scale's, moved on by its replicas' use this pass
        self.grown = 0.0                # request-seconds in flight on its replicas since the last pass
        self.span = span                # seconds since the last pass's counters; None: no two readings

    def concurrency(self) -> tuple[float, float] | None:
        return (self.grown, self.span) if self.span is not None else None


# A model with no record (never written to: signal() only reads a tally's lists).
NO_RECORDS = Tally(None, None)


class InFlight(Mapping[str, int]):
    """The usage snapshot's in-flight count per replica id, read in place (absent: 0 in flight).

    What `autoscale.signal` reads for a model's ready ids: one view for the
    whole pass instead of a dict per model of every id it keeps, and with the
    routers' counters `signal` reads none of them.
    """

    __slots__ = ("_usage",)

    def __init__(self, usage: UsageSnapshot):
        self._usage = usage

    def __getitem__(self, rid: str) -> int:
        return self._usage.get(rid, UNUSED)[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._usage)

    def __len__(self) -> int:
        return len(self._usage)


class Scaling:
    """Each model's scale, and the readings a pass scales on."""

    def __init__(self, event: Callable[[str, str], None], *, load: LoadSource | None = None,
                 concurrency: ConcurrencySource | None = None):
        self._event = event
        self.scales: dict[str, ModelScale] = {}
        # The engines' gauges for autoscaling on waiting or KV-cache use; read once a pass.
        self.load = load
        self.loads: Mapping[str, LoadReading] = {}
        # The routers' in-flight counters (request-seconds per replica), read once a pass and
        # differenced with the last pass's: the time-averaged concurrency the autoscaler scales on.
        self.concurrency = concurrency
        self._busy: tuple[float, Mapping[str, float]] | None = None      # (when, counters): this pass's
        self._busy_before: tuple[float, Mapping[str, float]] | None = None   # and the last pass's

    def get(self, model: str) -> ModelScale | None:
        return self.scales.get(model)

    def wanted_of(self, model: str, floor: int) -> int:
        """What `model` wants now, without a pass (its floor if it has no scale yet)."""
        scale = self.scales.get(model)
        return scale.wanted if scale is not None else floor

    # --- inputs between passes ------------------------------------------------

    def woken(self, model: str, at: float) -> None:
        """A request waits for `model` (the router's wake): it counts as wanted from `at`."""
        self._scale(model).woken = at

    def used(self, model: str, at: float) -> None:
        """`model` counts as used at `at` (an adopted replica: a scale-to-zero model found running
        after a restart gets its full idle timeout, not an instant stop)."""
        scale = self._scale(model)
        scale.last_used = max(scale.last_used or at, at)

    def timed_cold_start(self, rec: Replica, now: float) -> None:
        """A replica we placed is ready for the first time: its placement-to-ready time joins its model's.

        A mean over the last few (each new one weighs half), so one slow start
        (a cold page cache, a busy node) moves it but does not own it. Only
        replicas this controller placed: an adopted one's placement is unknown.
        """
        rec.timed = True
        scale = self._scale(rec.spec.model)
        took = max(0.0, now - rec.created)
        scale.cold_start = took if scale.cold_start <= 0 else (scale.cold_start + took) / 2

    def _scale(self, model: str) -> ModelScale:
        scale = self.scales.get(model)
        if scale is None:
            scale = self.scales[model] = ModelScale()
        return scale

    # --- the pass ---------------------------------------------------------------

    def read(self, now: float) -> None:
        """This pass's engine gauges and in-flight counters (the last pass's counters kept to difference)."""
        self.loads = dict(self.load.load_snapshot()) if self.load else {}
        self._busy_before = self._busy
        self._busy = (now, dict(self.concurrency.inflight_seconds())) if self.concurrency else None

    def wanted(self, catalog: Catalog, now: float, usage: UsageSnapshot, records: Records) -> dict[str, int]:
        """Every model's replica count for this pass, by name; says each change as a scale event.

        One walk of the records in their own order sums every model's
        (`tally`), rather than each model's filtered and summed apiece.
        """
        tallies = self.tally(now, usage, records)
        inflight_by = InFlight(usage)    # read in place: `signal` looks up only the ready ids
        scales = self.scales
        wanted = {}
        for model in catalog.models:
            scale = scales.get(model.name)
            if scale is None:
                scale = scales[model.name] = ModelScale(wanted=model.replicas.min)
            tally = tallies.get(model.name)
            if tally is None:
                tally = NO_RECORDS     # nothing ready: `signal` reads neither load nor concurrency
            else:
                scale.last_used = tally.last_used
            used = scale.last_used
            if scale.woken is not None and (used is None or scale.woken > used):
                used = scale.woken
            idle = model.idle_timeout is not None and (used is None or now - used >= model.idle_timeout)
            target = max(scale.wanted, model.replicas.min)
            why = "idle"
            target, why = self._autoscaled(model, scale, tally, inflight_by, now, used, idle, target, why)
            if model.replicas.min == 0 and used is not None and not idle:
                target = max(target, 1)
            if model.replicas.min == 0 and used is None:
                target = 0
            target = max(model.replicas.min, min(model.replicas.max, target))
            if target != scale.wanted:
                if target < scale.wanted:
                    self._event("scale-down", f"{model.name}: {scale.wanted} -> {target} replicas ({why})")
                else:
                    self._event("scale-up", f"{model.name}: {scale.wanted} -> {target} replicas"
                                + (f" ({why})" if why != "idle" else ""))
            scale.wanted = target
            wanted[model.name] = target
        if len(scales) > len(wanted):       # every model of the catalog has one: only then is one stale
            for name in [n for n in scales if catalog.resolve(n) is None]:
                del scales[name]
        return wanted

    def _autoscaled(self, model: Model, scale: ModelScale, tally: Tally, inflight_by: InFlight, now: float,
                    used: float | None, idle: bool, target: int, why: str) -> tuple[int, str]:
        """The policy's say in `target` (llmgwctl.reconciler.autoscale), and why; an idle model's is its floor."""
        # The catalog's block is frozen: the one the policy was resolved from resolves to it again.
        policy = scale.policy
        if policy is None or scale.policy_of is not model.autoscale:
            policy = model.autoscale.policy()
            if scale.policy != policy:
                scale.autoscaler.reset()     # a history gathered under another target means nothing now
                scale.policy = policy
            scale.policy_of = model.autoscale
        if idle:
            scale.autoscaler.reset()
            return model.replicas.min, why
        sig = signal(policy.metric, tally.ready, tally.starting, inflight_by, self.loads, tally.concurrency())
        # A scale-to-zero model in use keeps one replica: only its idle timeout takes it to zero.
        low = max(model.replicas.min, 1 if used is not None else 0)
        decision = scale.autoscaler.decide(policy, now, min(target, model.replicas.max), sig,
                                           low, model.replicas.max, cold_start=scale.cold_start)
        scale.load, scale.needed = decision.load, decision.needed
        if decision.reason:
            return decision.wanted, decision.reason
        return target, why

    def tally(self, now: float, usage: UsageSnapshot, records: Records) -> dict[str, Tally]:
        """Every model's records summed in one walk of them: by model name, for `wanted`.

        In the records' own order, not model by model: the lookups in the
        usage and counter snapshots stay near in memory. Draining and stopping
        replicas count only towards the concurrency: their requests are load
        the model still serves, but they are no capacity and their use does
        not keep the model awake.
        """
        # The members once, as locals: an enum member read is an attribute lookup per record.
        ready_state, gone, coming = ReplicaState.READY, GONE, COMING
        scales = self.scales
        tallies: dict[str, Tally] = {}
        counters = self.counters(now)
        span = counters[2] if counters is not None else None
        # The counters all as they were (no request in flight anywhere since the last pass):
        # nothing grew, and one comparison of the two snapshots says so without two lookups a record.
        busy_now = busy_before = None
        if counters is not None and counters[0] != counters[1]:
            busy_now, busy_before = counters[0].get, counters[1].get
        usage_get = usage.get
        for rec in records.values():
            spec = rec.spec
            if spec.group is not None and spec.group.rank:
                continue        # a worker of a group spanning nodes: its group counts once, as its head
            tally = tallies.get(spec.model)
            if tally is None:
                scale = scales.get(spec.model)
                tally = tallies[spec.model] = Tally(scale.last_used if scale is not None else None, span)
            rid = spec.id
            if busy_now is not None and busy_before is not None:
                # A replica new since the last pass starts from its first reading, and a counter
                # that went back (its router restarted, or listed it anew) adds nothing this pass.
                busy = busy_now(rid)
                if busy is not None:
                    before = busy_before(rid, busy)
                    if busy > before:
                        tally.grown += busy - before
            state = rec.state
            if state == ready_state:        # most are: asked first
                tally.ready.append(rid)
            elif state in coming:
                tally.starting += 1
            elif state in gone:
                continue
            use = usage_get(rid)
            if use is not None:
                last, n = use
                if last is not None and (not tally.last_used or last > tally.last_used):
                    tally.last_used = last      # max(last_used or last, last), without the call
                if n:
                    tally.last_used = now
        return tallies

    def counters(self, now: float) -> tuple[Mapping[str, float], Mapping[str, float], float] | None:
        """(this pass's in-flight counters, the last pass's, seconds between them); None without two readings.

        Differenced per replica in `tally`: request-seconds in flight since
        the last pass over those seconds is the time-averaged concurrency.
        """
        if self._busy is None or self._busy_before is None:
            return None
        (_, counters), (then, before) = self._busy, self._busy_before
        if now <= then:
            return None
        return counters, before, now - then
