"""The autoscaling policy's arithmetic: from a model's load and its catalog policy to a replica count.

Pure: no I/O, no clock of its own. The reconciler measures the load once a
pass (`signal()`), hands it to the model's `Autoscaler` with the pass's time,
and applies the count it gets back; tests drive it with made-up loads and
times. The policy itself (metric, target, windows, step) is the catalog's
`Autoscale` block; the rules, in the order `decide` applies them:

- needed = ceil(load / target), bounded by the model's min and max. The load
  is summed over the model's ready replicas and averaged over the passes of
  the last SMOOTH seconds; with no reading (no ready
  replica, an engine without that gauge) the count holds: no signal is not
  zero load.
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
- Down, when needed is below the count, only once the policy has watched the
  load for a whole `scale_down_window`, and only to the highest count any
  pass in that window needed (Kubernetes HPA's stabilization), at most
  `max_step` a step. A lull shorter than the window releases nothing.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

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


@dataclass(frozen=True, slots=True)
class Signal:
    """One pass's measurement of a model: its load and the replicas it was measured on."""

    load: float | None      # the metric summed over ready replicas; None: nothing to read
    ready: int = 0
    starting: int = 0       # placed or starting, not yet ready: capacity on its way


@dataclass(frozen=True, slots=True)
class Decision:
    wanted: int
    needed: int | None      # what the smoothed load needs (bounded); None: no signal
    load: float | None = None   # the smoothed load the decision was taken on
    reason: str = ""        # why `wanted` differs from the count asked about; "" when it does not


def signal(metric: str, ready_ids: Iterable[str], starting: int, inflight: Mapping[str, int],
           loads: Mapping[str, LoadReading]) -> Signal:
    """The load of a model's ready replicas for `metric`.

    `inflight` is what the routers count per replica (every router's summed);
    `loads` the engines' latest fresh gauges per replica. A replica with no
    gauge adds nothing; if none has one, the load is unknown.
    """
    ready_ids = list(ready_ids)
    if not ready_ids:
        return Signal(None, 0, starting)
    if metric == "inflight":
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
        self._recent: collections.deque[tuple[float, float]] = collections.deque()   # (time, load) for SMOOTH

    def reset(self) -> None:
        """Forget the history (the model went idle, or its policy changed): the next window starts fresh."""
        self._history.clear()
        self._recent.clear()
        self._since = None

    def decide(self, policy: ScalingPolicy, now: float, current: int, sig: Signal, low: int, high: int) -> Decision:
        """The count to want after this pass, given the count wanted now (`current`, starting replicas included)."""
        if sig.load is None:
            return Decision(current, None)
        self._recent.append((now, sig.load))
        while self._recent[0][0] <= now - SMOOTH:
            self._recent.popleft()
        load = sum(v for _, v in self._recent) / len(self._recent)
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
        what = (f"{policy.metric} {load:.3g} on {sig.ready} ready replica{'s' if sig.ready != 1 else ''}"
                f" (target {target:g} each)")
        if needed > current and not banded:
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
            return Decision(wanted, needed, load=load, reason=f"{what}; at most {recommended} needed throughout the last "
                            f"{format_duration(window)}")
        return Decision(current, needed, load=load)
