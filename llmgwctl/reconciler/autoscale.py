"""The autoscaling policy's arithmetic: from a model's load and its catalog policy to a replica count.

Pure: no I/O, no clock of its own. The reconciler measures the load once a
pass (`signal()`), hands it to the model's `Autoscaler` with the pass's time,
and applies the count it gets back; tests drive it with made-up loads and
times. The policy itself (metric, target, windows, step) is the catalog's
`Autoscale` block; the rules, in the order `decide` applies them:

- needed = ceil(load / target), bounded by the model's min and max. The load
  is summed over the model's ready replicas and averaged over the last few
  seconds: for `inflight` with the routers' counters, the time-averaged
  concurrency over the last SMOOTH_AVERAGED seconds (each request counted for
  as long as it was in flight); otherwise the mean of the passes' samples
  over the last SMOOTH seconds. With no reading (no ready replica, an engine
  without that gauge) the count holds: no signal is not zero load.
- The tolerance band (Kubernetes HPA's): while the load per wanted replica is
  within `tolerance` of the target, nothing changes either way. A burst a
  tenth over what the fleet is sized for is noise, and a replica bought on it
  is released a window later: a flap.
- Up, when needed exceeds the count wanted now. Replicas still starting are
  part of that count, so a slow cold start does not look like missing
  capacity and asks only for what the load needs beyond them. A step adds at
  most `max_step`; the next pass may step again (the step does not wait for
  its replicas to be ready: on a ramp, waiting a cold start per step is what
  left the first replicas queueing). The fast path: when the load per wanted
  replica is `fast_factor` times the target or more, go straight to `needed`.
- A step up is sized for the load when its replicas will be ready: the load
  plus its growth (the least-squares slope of the last TREND seconds, when
  positive) over the model's measured cold start, plus the smoothing's own
  lag. It only sizes a step the level above already takes; it never starts
  one, and never holds replicas the load does not need (issue 17's bench: a
  ramp grows by more than a replica's worth during one cold start, so a
  step sized for the load it was taken on is already short when it is
  ready; a trend allowed to start steps bought replicas on the noise of a
  quiet fleet and flapped).
- While a step's replicas are still starting, the growth may add to it:
  when the load grown over a cold start would be past the band's edge on
  the count wanted, step again now rather than once the level is there a
  cold start too late. A ramp that was flat when the level stepped (so the
  step was sized for no growth) and grows while its replicas start is the
  case: the level would step again only on the load past the band, and its
  replicas would be ready a cold start after that. Only a scale-up in
  progress is extended, never a quiet fleet's noise, and only while the
  load is above what its last step was taken on (a jump, then flat, is not
  a ramp however the fitted slope reads it). bench/README.md, "Fifth
  pass": all of issue 17's targets on 74 % -> 78 % of 300 seeds in the model.
- Down, when needed is below the count, only once the policy has watched the
  load for a whole `scale_down_window`, and only to the highest count any
  pass in that window needed (Kubernetes HPA's stabilization), at most
  `max_step` a step. A lull shorter than the window releases nothing.
"""
from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..catalog import ScalingPolicy, format_duration
from ..contracts import LoadReading

# Loads are sums of floats (KV fractions); 16.000000001 in flight is 16, not a
# reason for a seventeenth replica's worth of ceil().
_EPSILON = 1e-9
# The load is the mean of the last 3 s of passes (three router polls, three
# reconciler passes). One pass's in-flight count is a single sample of a
# Poisson-like process: at 3.4 requests in flight on average, 9 is seen a few
# times a minute, and stepping on it buys a replica the load does not need
# (the bench measured that costing a tenth of the replica-seconds). Three
# seconds is short next to any real engine's cold start.
SMOOTH = 3.0
# A time-average needs less: over 2 s it counts every request of those 2 s
# for as long as it ran, where three samples catch whichever requests happen
# to be in flight at three instants. At the bench's quietest (1 req/s of
# 0.43 s requests) its noise is a third of three samples' (0.3 against 0.8
# in flight, standard deviations), and it lags a second, not 1.5.
SMOOTH_AVERAGED = 2.0
# The growth is fitted over the last 8 s: eight passes' averages, enough to
# see a ramp through their noise, short next to the ramp itself.
TREND = 8.0
# What `_recent` keeps: the longest of the three.
_KEPT = max(SMOOTH, SMOOTH_AVERAGED, TREND)


@dataclass(frozen=True, slots=True)
class Signal:
    """One pass's measurement of a model: its load and the replicas it was measured on."""

    load: float | None      # the metric summed over ready replicas; None: nothing to read
    ready: int = 0
    starting: int = 0       # placed or starting, not yet ready: capacity on its way
    span: float | None = None   # seconds `load` is the time-average over; None: a sample at one instant


@dataclass(frozen=True, slots=True)
class Decision:
    wanted: int
    needed: int | None      # what the smoothed load needs (bounded); None: no signal
    load: float | None = None   # the smoothed load the decision was taken on
    reason: str = ""        # why `wanted` differs from the count asked about; "" when it does not


def signal(metric: str, ready_ids: Iterable[str], starting: int, inflight: Mapping[str, int],
           loads: Mapping[str, LoadReading], concurrency: tuple[float, float] | None = None) -> Signal:
    """The load of a model's ready replicas for `metric`.

    `inflight` is what the routers count per replica (every router's summed);
    `loads` the engines' latest fresh gauges per replica. A replica with no
    gauge adds nothing; if none has one, the load is unknown. `concurrency`
    is (request-seconds in flight on the model, seconds) since the last pass,
    from the routers' counters: for `inflight` it is the load, as a
    time-average, in place of the one sample `inflight` is.
    """
    ready_ids = list(ready_ids)
    if not ready_ids:
        return Signal(None, 0, starting)
    if metric == "inflight":
        if concurrency is not None and concurrency[1] > 0:
            seconds, span = concurrency
            return Signal(seconds / span, len(ready_ids), starting, span=span)
        return Signal(float(sum(inflight.get(rid, 0) for rid in ready_ids)), len(ready_ids), starting)
    values = []
    for rid in ready_ids:
        reading = loads.get(rid)
        if reading is None:
            continue
        value = reading.waiting if metric == "waiting" else reading.kv_cache
        if value is not None:
            values.append(float(value))
    return Signal(sum(values) if values else None, len(ready_ids), starting)


class Autoscaler:
    """One model's policy state: the needed counts of the last window's passes."""

    def __init__(self) -> None:
        self._history: collections.deque[tuple[float, int]] = collections.deque()
        self._since: float | None = None     # first pass of the unbroken history
        # (pass time, load, weight, when it stands) for the smoothing and the trend: a time-average
        # weighs what it spans and stands at its middle, a sample weighs 1 and stands at its pass
        self._recent: collections.deque[tuple[float, float, float, float]] = collections.deque()
        self._stepped_on: float | None = None    # the pass's load (not the mean) the last step up was taken on

    def reset(self) -> None:
        """Forget the history (the model went idle, or its policy changed): the next window starts fresh."""
        self._history.clear()
        self._recent.clear()
        self._since = None
        self._stepped_on = None

    def _smoothed(self, now: float, sig: Signal) -> float:
        smooth = SMOOTH if sig.span is None else SMOOTH_AVERAGED
        # From the newest back to the window's start, not over all TREND keeps: the passes are
        # in time order (one clock, appended as they come), and every model's mean is taken
        # every pass (issue 19: 1,001 models). Summed oldest first as before: the same floats.
        recent = []
        for t, v, w, _ in reversed(self._recent):
            if t <= now - smooth:
                break
            recent.append((v, w))
        recent.reverse()
        weight = sum(w for _, w in recent)
        return sum(v * w for v, w in recent) / weight if weight > 0 else sig.load   # type: ignore[return-value]

    def _trend(self, now: float) -> float:
        """The load's growth per second over the last TREND seconds (weighted least squares); 0 with too little."""
        points = [(mid, v, w) for t, v, w, mid in self._recent if t > now - TREND]
        weight = sum(w for _, _, w in points)
        if len(points) < 3 or weight <= 0 or points[-1][0] - points[0][0] < TREND / 2:
            return 0.0
        mt = sum(t * w for t, _, w in points) / weight
        mv = sum(v * w for _, v, w in points) / weight
        var = sum(w * (t - mt) ** 2 for t, _, w in points)
        return sum(w * (t - mt) * (v - mv) for t, v, w in points) / var if var > 0 else 0.0

    def decide(self, policy: ScalingPolicy, now: float, current: int, sig: Signal, low: int, high: int,
               cold_start: float = 0.0) -> Decision:
        """The count to want after this pass, given the count wanted now (`current`, starting replicas included).

        `cold_start`: seconds from placing a replica of this model to its being ready, as measured (0: not
        known yet, and steps are sized for the load as it is).
        """
        d = self._level(policy, now, current, sig, low, high, cold_start)
        if d.wanted > current:
            self._stepped_on = sig.load
        if d.wanted != current or d.load is None or sig.starting <= 0 or cold_start <= 0:
            return d
        # A scale-up in progress: extended when this pass's load is above the one its last step was
        # taken on (a jump to a new level goes on looking like growth in the smoothed mean and the
        # fitted slope for seconds, but it has stopped growing) and the load grown over a cold start
        # is past the band's edge on the count wanted (the edge, not the target: what the band would
        # let the level do then).
        if self._stepped_on is None or sig.load is None or sig.load <= self._stepped_on:
            return d
        growth = self._trend(now)
        if growth <= 0:
            return d
        horizon = cold_start + (SMOOTH if sig.span is None else SMOOTH_AVERAGED) / 2
        ahead = min(high, math.ceil((d.load + growth * horizon) / (policy.target * (1 + policy.tolerance))
                                    - _EPSILON))
        if ahead <= current:
            return d
        wanted = min(ahead, current + policy.max_step)
        self._history[-1] = (now, max(self._history[-1][1], wanted))    # held like any need
        self._stepped_on = sig.load
        return Decision(wanted, d.needed, load=d.load, reason=(
            f"{policy.metric} {d.load:.3g} on {sig.ready} ready and {sig.starting} starting, growing {growth:.2g}/s: "
            f"{d.load + growth * horizon:.3g} by the time a replica placed now is ready ({horizon:.1f} s), past "
            f"{current} x {policy.target:g} + {policy.tolerance:.0%}"))

    def _level(self, policy: ScalingPolicy, now: float, current: int, sig: Signal, low: int, high: int,
               cold_start: float) -> Decision:
        """`decide` by the level, the band, the window and a step's sizing: all but a scale-up's extension."""
        if sig.load is None:
            return Decision(current, None)
        if sig.span is None:
            self._recent.append((now, sig.load, 1.0, now))
        else:
            self._recent.append((now, sig.load, sig.span, now - sig.span / 2))
        while self._recent[0][0] <= now - _KEPT:
            self._recent.popleft()
        load = self._smoothed(now, sig)
        target = policy.target
        needed = max(low, min(high, math.ceil(load / target - _EPSILON)))
        window = policy.scale_down_window
        self._history.append((now, needed))
        while self._history and self._history[0][0] < now - window:
            self._history.popleft()
        if self._since is None:
            self._since = now
        per = load / max(current, 1)
        # Inside the band the count holds -- unless min or max moved under it.
        banded = current > 0 and abs(per / target - 1) <= policy.tolerance + _EPSILON and low <= current <= high
        if needed > current and not banded:
            what = _measured(policy, load, sig)
            growth = self._trend(now) if cold_start > 0 else 0.0
            if growth > 0:
                horizon = cold_start + (SMOOTH if sig.span is None else SMOOTH_AVERAGED) / 2
                ahead = max(low, min(high, math.ceil((load + growth * horizon) / target - _EPSILON)))
                if ahead > needed:
                    needed = ahead
                    self._history[-1] = (now, needed)       # what the step was sized for holds like any need
                    what += (f", growing {growth:.2g}/s: {load + growth * horizon:.3g} by the time a replica "
                             f"placed now is ready ({horizon:.1f} s)")
            if per >= policy.fast_factor * target:
                return Decision(needed, needed, load=load, reason=f"{what} needs {needed}; fast path: {per / target:.1f}x the "
                                f"target per wanted replica, at least {policy.fast_factor:g}x")
            wanted = min(needed, current + policy.max_step)
            return Decision(wanted, needed, load=load, reason=f"{what} needs {needed}"
                            + (f"; a step of at most {policy.max_step}" if wanted < needed else ""))
        if needed < current and not banded:
            if now - self._since < window:
                return Decision(current, needed, load=load)    # not watched for a whole window yet
            recommended = max(n for _, n in self._history)
            if recommended >= current:
                return Decision(current, needed, load=load)
            wanted = max(recommended, current - policy.max_step, low)
            return Decision(wanted, needed, load=load, reason=f"{_measured(policy, load, sig)}; at most {recommended} "
                            f"needed throughout the last {format_duration(window)}")
        return Decision(current, needed, load=load)


def _measured(policy: ScalingPolicy, load: float, sig: Signal) -> str:
    """What a reason starts with: the load it was taken on. Formatted only for a reason (a pass holds
    most models' counts, and formatting one for each of issue 19's 1,001 models was a pass's millisecond)."""
    return (f"{policy.metric} {load:.3g} on {sig.ready} ready replica{'s' if sig.ready != 1 else ''}"
            f" (target {policy.target:g} each)")
