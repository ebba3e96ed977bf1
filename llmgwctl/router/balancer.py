"""Choosing an endpoint: priority tiers, load per unit of weight, power of two choices.

Owns the router's mutable per-endpoint state -- in-flight count, last use,
the latest load reading, ejection after connection failures -- and the pick.
Others change that state through its methods (`started`, `finished`,
`record`, `eject`, `succeeded`), never by writing an `EndpointState`.
It must not know about HTTP, the catalog or the controller: it is handed the
endpoint list whole and asked, per request, for one endpoint of one model.

The pick, for one model:

1. Tiers are the model's endpoints grouped by priority, highest first. The
   first tier with an endpoint that has capacity is used; an endpoint lacks
   capacity when its load as this router counts it now (its own in-flight
   requests, immediate, plus other routers' share from the last reading)
   reaches the count its engine was last seen full at (requests waiting: every
   slot taken; or its KV cache nearly full). If no tier has capacity, the
   highest tier with a usable endpoint takes the request and it queues at
   that engine, which is where the best profile's queue belongs.
2. Within the tier: two endpoints drawn at random, the one with less load per
   unit of weight wins (power of two choices). Where weights differ the two
   are drawn by weight and a tie goes to the first drawn, so idle endpoints
   (every sequential request is a tie) share traffic by weight too. Always taking the global least
   loaded would send every request arriving in the same poll interval to the
   same endpoint (herding); two random choices keep nearly the same balance
   without that.
   A per-request `Chooser` (see the `policies` package: round robin,
   prefix and session affinity) may take this step's place; it is handed
   the same candidates, so tiers, room and ejection hold for every policy.
3. Ejected endpoints (a refused or reset connection) are skipped until their
   ejection runs out; if every endpoint of the model is ejected, they are used
   anyway rather than failing a request on a guess.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from ..contracts import Endpoint, LoadReading, Usage
from .adapterload import AdapterLoad

# An engine is treated as full when this much of its KV cache is in use: past
# it, vLLM and SGLang start preempting or queueing, so a lower tier with room
# serves the next request sooner.
KV_FULL = 0.95


class EndpointState:
    """What the router knows about one endpoint right now. Mutated only on the event loop."""

    __slots__ = ("endpoint", "replica_id", "weight", "inflight", "last_used",
                 "load", "load_at", "others", "full_at", "ejected_until", "failures", "busy", "busy_at")

    def __init__(self, endpoint: Endpoint, last_used: float | None = None, now: float = 0.0):
        self.endpoint = endpoint
        self.replica_id = endpoint.replica_id
        self.weight = endpoint.weight
        self.inflight = 0
        self.last_used = last_used
        # In flight integrated over time up to busy_at (request-seconds; see
        # contracts.usage): the autoscaler's time-averaged concurrency.
        self.busy = 0.0
        self.busy_at = now
        self.load: LoadReading | None = None
        self.load_at = float("-inf")
        # What the latest reading says beyond this router's own count: the
        # requests the engine held that this router did not send (other
        # routers'), and the count at which it was last seen full (its slots,
        # or its KV cache); None when no reading has shown it full.
        self.others = 0.0
        self.full_at: float | None = None
        self.ejected_until = float("-inf")
        self.failures = 0

    def __repr__(self) -> str:
        return f"<EndpointState {self.replica_id} inflight={self.inflight} load={self.load}>"


Tiers = tuple[tuple[EndpointState, ...], ...]


class Chooser(Protocol):
    """Picks one of a tier's candidates for one request, in place of the two random choices.

    Declared here, by the pick that calls it, so a routing policy (the
    `policies` package, which re-exports it) plugs in without the balancer
    knowing any policy: the balancer still decides which endpoints are
    candidates (tier, room, ejection). Here and not in `policies`: that
    package imports the balancer (`EndpointState`, its load score), so the
    balancer importing it back would be an import cycle.
    """

    def choose(self, cands: Sequence[EndpointState], now: float) -> EndpointState: ...


class Balancer:
    """Per-endpoint state and the pick. `set_endpoints` replaces the list; state survives for ids kept."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, stale_after: float = 3.0,
                 eject_base: float = 1.0, eject_max: float = 30.0, rng: random.Random | None = None):
        self._clock = clock
        # A reading older than this is unknown, not idle: an engine that stopped
        # answering /metrics may be wedged under load. The router passes 3 poll intervals.
        self.stale_after = stale_after
        self._eject_base = eject_base
        self._eject_max = eject_max
        self._rand: Callable[[], float] = (rng or random.Random()).random
        self._states: dict[str, EndpointState] = {}
        # Endpoints taken out of the list while requests were still running on them.
        self._withdrawn: dict[str, EndpointState] = {}
        self._tiers: dict[str, Tiers] = {}
        self._members: dict[str, dict[str, EndpointState]] = {}     # model -> its endpoints' states by id
        self._profiles: dict[str, frozenset[str]] = {}
        self.generation = 0     # bumped on every change, so callers can cache derived views
        # Per adapter name, its requests in flight over time, wherever they ran (adapterload.py).
        self.adapters = AdapterLoad(clock)

    # -- told by the controller ------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> set[str]:
        """Replace the endpoint list; return the models that gained an endpoint.

        An endpoint kept under the same replica id with the same fields keeps
        its counters and readings. A request already running on a removed
        endpoint holds its own reference to the state, so finishing it is safe.
        Applied as the changes from the list held (`change_endpoints`): only the
        models whose endpoints came, went or changed get their tiers rebuilt.
        """
        gained, _, _ = self.change_endpoints(self.changes_to(endpoints))
        return gained

    def changes_to(self, endpoints: Iterable[Endpoint]) -> dict[str, Endpoint | None]:
        """What turns the list held into `endpoints`, as `change_endpoints` takes it; ValueError if an id is listed twice."""
        held = self._states
        listed: set[str] = set()
        changed: dict[str, Endpoint | None] = {}
        for ep in endpoints:
            rid = ep.replica_id
            if rid in listed:
                raise ValueError(f"replica id {rid!r} appears twice in the endpoint list")
            listed.add(rid)
            prev = held.get(rid)
            # `is` first: the reconciler hands the same Endpoint object while nothing about
            # a replica changed, and a dataclass == of every field, 20,000 times, was a third of it.
            if prev is None or not (prev.endpoint is ep or prev.endpoint == ep):
                changed[rid] = ep
        if len(listed) != len(held) or changed:
            changed.update((rid, None) for rid in held if rid not in listed)
        return changed

    def change_endpoints(self, changed: Mapping[str, Endpoint | None]) -> tuple[set[str], list[Endpoint], list[str]]:
        """Change the list by `changed` (replica id -> its new Endpoint, or None: it left).

        At the cost of the changes: a publish that turns a few replicas ready
        among tens of thousands does not walk them all. Changed fields (a new
        url after a restart) mean fresh counters, but the last use still counts
        for the idle timeout. Returns the models that gained an endpoint, the
        endpoints added or replaced, and the ids removed.
        """
        touched: set[str] = set()
        gained: set[str] = set()
        added: list[Endpoint] = []
        removed: list[str] = []
        now = self._clock()
        members = self._members
        for rid, ep in changed.items():
            prev = self._states.get(rid)
            if ep is None:
                if prev is None:
                    continue
                del self._states[rid]
                for key in _keys(prev.endpoint):
                    del members[key][rid]
                    touched.add(key)
                removed.append(rid)
                if prev.inflight > 0:
                    self._withdrawn[rid] = prev
                continue
            if prev is not None and (prev.endpoint is ep or prev.endpoint == ep):
                continue
            old_keys = _keys(prev.endpoint) if prev is not None else ()
            if prev is not None and _same_but_adapters(prev.endpoint, ep):
                # Only its adapters changed (one loaded or unloaded): the same
                # engine, so its counts and readings stand.
                st = prev
                st.endpoint = ep
            else:
                st = EndpointState(ep, prev.last_used if prev else None, now)
            new_keys = _keys(ep)
            for key in old_keys:
                if key not in new_keys:
                    del members[key][rid]
                    touched.add(key)
            for key in new_keys:
                if key not in old_keys:
                    gained.add(key)
                members.setdefault(key, {})[rid] = st
                touched.add(key)
            self._states[rid] = st
            added.append(ep)
        if touched:
            self._retier(touched)
            self.generation += 1
        return gained, added, removed

    def _retier(self, models: Iterable[str]) -> None:
        """Build the tiers (and the profiles) of `models` again from their endpoints."""
        for model in models:
            tiers: dict[int, list[EndpointState]] = {}
            for st in self._members.get(model, {}).values():
                tiers.setdefault(st.endpoint.priority, []).append(st)
            if tiers:
                self._tiers[model] = tuple(tuple(tiers[p]) for p in sorted(tiers, reverse=True))
                self._profiles[model] = frozenset(st.endpoint.profile for tier in tiers.values() for st in tier)
            else:
                self._tiers.pop(model, None)
                self._profiles.pop(model, None)
                self._members.pop(model, None)

    def count(self) -> int:
        """Endpoints listed now."""
        return len(self._states)

    # -- read by the controller and the poller ---------------------------------

    def states(self) -> tuple[EndpointState, ...]:
        return tuple(self._states.values())

    def state_of(self, replica_id: str) -> EndpointState | None:
        """The state of the endpoint listed under `replica_id` now; None if it is not listed."""
        return self._states.get(replica_id)

    def usage_snapshot(self) -> dict[str, Usage]:
        snapshot = {rid: Usage(st.last_used, st.inflight) for rid, st in self._states.items()}
        # A withdrawn endpoint still carrying requests is what the controller's
        # drain waits on: report it until its last request finishes, then let
        # it fall out (absent means nothing in flight).
        for rid, st in list(self._withdrawn.items()):
            if st.inflight <= 0:
                del self._withdrawn[rid]
            else:
                snapshot.setdefault(rid, Usage(st.last_used, st.inflight))
        return snapshot

    def inflight_seconds(self) -> dict[str, float]:
        """{replica_id: its in-flight count integrated over time, up to now} (a ConcurrencySource).

        Withdrawn endpoints still carrying requests are included, like in
        `usage_snapshot`: their requests are load the model still serves.
        """
        now = self._clock()
        out = {rid: st.busy + st.inflight * (now - st.busy_at) for rid, st in self._withdrawn.items()}
        out.update((rid, st.busy + st.inflight * (now - st.busy_at)) for rid, st in self._states.items())
        return out

    def load_snapshot(self) -> dict[str, LoadReading]:
        """{replica_id: its engine's latest reading}, only readings fresher than `stale_after`: the
        autoscaler's engine gauges (a stale one is unknown, as for the pick, never idle)."""
        now = self._clock()
        return {rid: st.load for rid, st in self._states.items()
                if st.load is not None and now - st.load_at <= self.stale_after}

    def ready_count(self, model: str) -> int:
        return sum(len(tier) for tier in self._tiers.get(model, ()))

    def has_profile(self, model: str, profile: str) -> bool:
        profiles = self._profiles.get(model)
        return profiles is not None and profile in profiles

    def record(self, state: EndpointState, reading: LoadReading | None, sent_inflight: int | None = None) -> None:
        """Store a poll result; None (no reading, or the poll failed) keeps the old one ageing into unknown.

        `sent_inflight` is this router's in-flight count when the poll was
        sent. The reading is kept as two things the pick adds to its own
        count, which is always current (a reading is up to a poll old, and at
        a second a poll a request of half a second has come and gone):

        - `others`: what the engine held beyond this router's requests. Of
          our own count, the larger of then and now: requests started while
          the poll was in flight may not have reached the engine, ones that
          finished may still be in its gauges; either way the engine's
          figure minus ours errs low, so one router alone sees ~0 and many
          routers see each other's traffic as before.
        - `full_at`: when the engine queues (waiting > 0) or its KV cache is
          nearly full, the count it held running then: its capacity. It is
          kept across readings (a batch limit does not move) until one shows
          more running with nothing queued.
        """
        if reading is None:
            return
        state.load = reading
        state.load_at = self._clock()
        ours = state.inflight if sent_inflight is None else max(sent_inflight, state.inflight)
        state.others = max(0.0, reading.running + reading.waiting - ours)
        if reading.waiting > 0 or (reading.kv_cache is not None and reading.kv_cache >= KV_FULL):
            state.full_at = reading.running
        elif state.full_at is not None and reading.running >= state.full_at:
            state.full_at = None

    # -- the hot path ------------------------------------------------------------

    def pick(self, model: str, exclude: tuple[EndpointState, ...] = (),
             chooser: Chooser | None = None) -> EndpointState | None:
        tiers = self._tiers.get(model)
        if not tiers:
            return None
        now = self._clock()
        candidates, _ = self._candidates(tiers, exclude, now)
        if candidates is not None:
            return self._two_choices(candidates, now) if chooser is None else chooser.choose(candidates, now)
        # Everything is ejected: the soonest to come back is the best guess.
        rest = [st for tier in tiers for st in tier if st not in exclude]
        return min(rest, key=lambda st: st.ejected_until) if rest else None

    def room(self, model: str) -> bool | None:
        """Whether a request for `model` sent now finds an endpoint that can take it, as `pick` judges:
        True when one has a free slot, False when every usable one is full, None when none is usable
        (none listed, or every one ejected). What router/fallback.py decides by."""
        tiers = self._tiers.get(model)
        if not tiers:
            return None
        candidates, roomy = self._candidates(tiers, (), self._clock())
        return None if candidates is None else roomy

    def _candidates(self, tiers: Tiers, exclude: tuple[EndpointState, ...],
                    now: float) -> tuple[list[EndpointState] | None, bool]:
        """What a pick chooses among, and whether they have room: the usable endpoints (not ejected, not
        excluded) with a free slot of the best tier that has any, else the best tier's usable ones; None
        when none is usable. One walk for `pick` and `room`, so the two judge alike."""
        first_usable = None
        for tier in tiers:
            usable = [st for st in tier if st.ejected_until <= now and st not in exclude]
            if not usable:
                continue
            if first_usable is None:
                first_usable = usable
            roomy = [st for st in usable if self._has_room(st, now)]
            if roomy:
                return roomy, True
        return first_usable, False

    def has_other(self, model: str, exclude: tuple[EndpointState, ...]) -> bool:
        """Whether a pick for `model` excluding `exclude` would find an endpoint (ejected ones count, as in `pick`)."""
        return any(st not in exclude for tier in self._tiers.get(model, ()) for st in tier)

    def has_usable(self, model: str, exclude: tuple[EndpointState, ...]) -> bool:
        """Whether `model` has an endpoint not in `exclude` that is in routing now (not ejected)."""
        now = self._clock()
        return any(st.ejected_until <= now and st not in exclude for tier in self._tiers.get(model, ()) for st in tier)

    def _has_room(self, st: EndpointState, now: float) -> bool:
        """Whether a request sent now would find a free slot: the load as `busy` counts it, below the
        count the engine was last seen full at. A reading that showed it full stops counting as
        full as soon as this router's own requests on it have finished, not a poll later."""
        full_at = st.full_at
        if full_at is None:
            return True     # never seen full: nothing says it is
        if now - st.load_at > self.stale_after:
            # Unknown: only our own count, which is never stale, can say it is full.
            return st.inflight < full_at
        return st.inflight + st.others < full_at

    def score(self, st: EndpointState, now: float) -> float:
        """Load per unit of weight; lower is better."""
        return self.busy(st, now) / st.weight

    def busy(self, st: EndpointState, now: float) -> float:
        """The endpoint's load in requests, before weighting."""
        if st.load is None or now - st.load_at > self.stale_after:
            # Unknown is not idle: count one request more than we know of, so a
            # peer known to be idle wins a tie but this one still takes traffic
            # when its peers are busy. An engine without metrics is not stale.
            return st.inflight + (0 if st.endpoint.metrics_path is None else 1)
        # Our in-flight count is immediate; the engine's gauges lag a poll but
        # include other routers' traffic (`others`, see `record`). The KV
        # cache's fill says when the engine is full (`_has_room`), not how
        # loaded: weighing the load by a poll-old fill (as this once did) sent
        # every router to the replicas that happened to be idle at the last
        # poll (bench/README.md, "Fifth pass").
        return st.inflight + st.others

    def two_choices(self, cands: list[EndpointState], now: float) -> EndpointState:
        """Least-load's pick among `cands`, for a chooser that has no better idea."""
        return self._two_choices(cands, now)

    def random(self) -> float:
        """The balancer's random source (seeded in tests), for choosers breaking ties."""
        return self._rand()

    def _two_choices(self, cands: list[EndpointState], now: float) -> EndpointState:
        n = len(cands)
        if n == 1:
            return cands[0]
        rand = self._rand
        w0 = cands[0].weight
        if all(st.weight == w0 for st in cands):
            i = int(rand() * n)
            j = int(rand() * (n - 1))
            if j >= i:
                j += 1
            a, b = cands[i], cands[j]
        else:
            # Draw the two by weight, the first one first. When their loads tie
            # (idle endpoints: every sequential request; or both unknown) the
            # first drawn wins, and that is endpoint k with probability
            # weight_k / total: the weights split traffic at any load, not only
            # once queues form. Unequal loads compare per unit of weight.
            total = sum(st.weight for st in cands)
            i = _draw(cands, rand() * total, -1)
            j = _draw(cands, rand() * (total - cands[i].weight), i)
            a, b = cands[i], cands[j]
            busy_a, busy_b = self.busy(a, now), self.busy(b, now)
            if busy_a == busy_b or busy_a / a.weight <= busy_b / b.weight:
                return a
            return b
        # a and b are in random order, so a tie goes either way.
        return a if self.score(a, now) <= self.score(b, now) else b

    # -- a request's life on an endpoint ---------------------------------------------

    def started(self, state: EndpointState) -> None:
        """A request goes to `state`: it counts as load from now, and as use for the idle timeout."""
        now = self._clock()
        state.busy += state.inflight * (now - state.busy_at)
        state.busy_at = now
        state.inflight += 1
        state.last_used = now

    def finished(self, state: EndpointState) -> None:
        """The request `started` on `state` is over, however it ended; its end is the endpoint's last use."""
        now = self._clock()
        state.busy += state.inflight * (now - state.busy_at)
        state.busy_at = now
        state.inflight -= 1
        state.last_used = now

    # -- outcomes -----------------------------------------------------------------

    def eject(self, state: EndpointState) -> float:
        """Keep `state` out of picks for a while after a refused or reset connection; return for how long.

        The time doubles with each consecutive failure: 1 s first, because the
        requests right behind the failure should go elsewhere but a blip should
        cost only a second of capacity; capped at 30 s, because an engine that
        restarts is back in tens of seconds and one that is really gone is
        withdrawn by the controller.
        """
        state.failures += 1
        duration: float = min(self._eject_base * 2 ** (state.failures - 1), self._eject_max)
        # Never shorter than an ejection already in force: a request failing on
        # a replica held out until it answers (outlier.py) must not let it back.
        state.ejected_until = max(state.ejected_until, self._clock() + duration)
        return duration

    def keep_out(self, state: EndpointState, until: float) -> None:
        """Keep `state` out of picks until `until` (this balancer's clock), whatever its failure count says:
        an ejection for a cause decided elsewhere (see ejection.py)."""
        state.ejected_until = max(state.ejected_until, until)

    @staticmethod
    def readmit(state: EndpointState) -> None:
        """Take `state` back into picks now: what kept it out (see ejection.Ejector.answered) is over."""
        state.ejected_until = float("-inf")
        state.failures = 0

    @staticmethod
    def succeeded(state: EndpointState) -> None:
        state.failures = 0


def _keys(ep: Endpoint) -> tuple[str, ...]:
    """The names an endpoint is picked under: its model's, and each LoRA adapter's it serves now.

    An adapter's name is a model name of its own (unique across the catalog),
    so the pick, the tiers and the cold-start wait treat it as a model whose
    endpoints are the base's replicas holding it.
    """
    return (ep.model, *ep.adapters) if ep.adapters else (ep.model,)


def _same_but_adapters(a: Endpoint, b: Endpoint) -> bool:
    return (a.replica_id, a.model, a.profile, a.engine, a.url, a.priority, a.weight, a.metrics_path) == \
        (b.replica_id, b.model, b.profile, b.engine, b.url, b.priority, b.weight, b.metrics_path)


def _draw(cands: list[EndpointState], point: float, skip: int) -> int:
    """The index whose share of the weights, laid end to end (without `skip`), holds `point`."""
    last = -1
    for k, st in enumerate(cands):
        if k == skip:
            continue
        point -= st.weight
        last = k
        if point < 0:
            return k
    return last     # rounding left `point` at the very end: the last one
