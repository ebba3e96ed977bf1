"""Traffic over time, per model and fleet-wide: a bounded in-memory history for the console's charts.

    GET /api/v1/history[?model=NAME][&since=T]
        {"interval": 5.0, "points": 720, "fields": [...],
         "t": [wall-clock seconds, ...],                      # oldest first
         "fleet": {FIELD: [value or null, ...]},
         "models": {NAME: {FIELD: [...]}}}                     # with model=: that model only

Every `interval` seconds (`sample()`, the one-pass method its loop calls) one
point is closed for each model of the catalog and for the whole fleet:

    requests    requests answered per second (any status)
    errors      5xx answers per second (the service's failures; 4xx are the client's)
    ttft_p50, ttft_p99   seconds to the first byte, over that interval's requests (null: none)
    tokens_in, tokens_out   tokens per second, from the engines' usage blocks
    inflight    requests in flight at the sample (the routers' counts)
    desired, ready   replicas the reconciler wants and has ready
    load, target     the autoscaler's measured load and its target per replica (models only)

Requests are taken as they end, from the request log's records (`observe`);
the rest is read from the fleet's status at the sample. With `since`, only
points after T: what a live page asks for after its first read.

Bounded: POINTS points (an hour at the default interval) in column rings of
4-byte floats sharing one time ring, so a model costs ~35 KB whatever its
traffic; a window's TTFTs are counted in log-spaced buckets (within 5 % of
the exact percentile), not kept. Only the catalog's models get series, at
most MAX_MODELS; a model gone from the catalog keeps its points until they
age out, then its series goes.

It must not know how the page draws it.
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..contracts import RequestRecord

# Five seconds a point: a rise and fall over a minute shows as a dozen
# points, and an hour is 720 of them, one JSON answer of a few KB per model.
INTERVAL = 5.0
POINTS = 720
FIELDS = ("requests", "errors", "ttft_p50", "ttft_p99", "tokens_in", "tokens_out", "inflight",
          "desired", "ready", "load", "target")
# Series kept at once: a catalog larger than this charts its first MAX_MODELS models.
MAX_MODELS = 1000
# TTFT buckets: from 1 ms, each 10 % wider than the last (a percentile read off
# a bucket's middle is within 5 % of the exact one), up to ~70 minutes.
_B0, _RATIO, _BUCKETS = 0.001, 1.1, 160
_LOG_RATIO = math.log(_RATIO)
_NAN = float("nan")
# Records held before they are counted: a list of them is a few hundred KB.
FOLD_AT = 4096


class ModelSample(NamedTuple):
    """What the fleet's status says of one model at a sample."""

    name: str
    inflight: float
    desired: float
    ready: float
    load: float | None
    target: float | None


@dataclass
class _Window:
    """The requests of one model (or the fleet) that ended since the last sample."""

    requests: int = 0
    errors: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    ttft: dict[int, int] = field(default_factory=dict)     # bucket -> count
    ttft_n: int = 0

    def percentile(self, q: float) -> float:
        if not self.ttft_n:
            return _NAN
        rank = max(1, math.ceil(q * self.ttft_n))
        seen = 0
        for b in sorted(self.ttft):
            seen += self.ttft[b]
            if seen >= rank:
                return float(_B0 * _RATIO ** (b + 0.5))
        return _NAN     # not reached: the counts add up to ttft_n


class History:
    """Column rings of POINTS points per model and for the fleet; `observe` per request, `sample` per interval."""

    def __init__(self, interval: float = INTERVAL, points: int = POINTS, max_models: int = MAX_MODELS):
        self.interval = interval
        self.points = points
        self.max_models = max_models
        self._t = array("d", [_NAN]) * points
        self._head = 0          # where the next point goes
        self._count = 0         # points held (up to `points`)
        self._series: dict[str, dict[str, array[float]]] = {}
        self._fleet = self._new_series()
        self._windows: dict[str, _Window] = {}
        self._fleet_window = _Window()
        self._pending: list[RequestRecord] = []
        self._last_at: float | None = None
        self.version = 0        # bumped per sample, so a stream knows a point is new

    def _new_series(self) -> dict[str, array[float]]:
        return {f: array("f", [_NAN]) * self.points for f in FIELDS}

    def observe(self, rec: RequestRecord) -> None:
        """One request that ended (a request log listener, on the router's path: it only appends; the
        records are counted in batches, at the sample or every FOLD_AT records)."""
        pending = self._pending
        pending.append(rec)
        if len(pending) >= FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        """Count the pending records into the windows: one loop with no call per record but the bucket's log."""
        pending, self._pending = self._pending, []
        windows, fleet, cap = self._windows, self._fleet_window, self.max_models
        log, b0, lr, top = math.log, _B0, _LOG_RATIO, _BUCKETS - 1
        for rec in pending:
            status, tin, tout, ttft = rec.status, rec.tokens_in, rec.tokens_out, rec.ttft
            # Only answers with a first byte from an engine: a refusal's "TTFT" is the router's own speed.
            b = -1
            if ttft is not None and rec.replica:
                b = 0 if ttft <= b0 else min(top, int(log(ttft / b0) / lr))
            w = windows.get(rec.model) if rec.model else None
            if w is None and rec.model and len(windows) < cap:
                w = windows[rec.model] = _Window()
            # Names beyond any catalog's (a hostile router's) count for the fleet only.
            for win in (fleet, w) if w is not None else (fleet,):
                win.requests += 1
                if status >= 500:
                    win.errors += 1
                if tin:
                    win.tokens_in += tin
                if tout:
                    win.tokens_out += tout
                if b >= 0:
                    win.ttft[b] = win.ttft.get(b, 0) + 1
                    win.ttft_n += 1

    def sample(self, now: float, models: Iterable[ModelSample]) -> None:
        """Close the window: one point at wall-clock `now` for each of `models` and for the fleet."""
        self._fold()
        # Rates over the time the window really covered: a late tick is not a burst.
        span = self.interval if self._last_at is None else max(1e-3, now - self._last_at)
        self._last_at = now
        i = self._head
        self._t[i] = now
        windows, self._windows = self._windows, {}
        fleet_w, self._fleet_window = self._fleet_window, _Window()
        totals = [0.0, 0.0, 0.0]
        sampled = set()
        for m in models:
            series = self._series.get(m.name)
            if series is None:
                if len(self._series) >= self.max_models:
                    continue
                series = self._series[m.name] = self._new_series()
            sampled.add(m.name)
            self._put(series, i, windows.get(m.name) or _Window(), span,
                      (m.inflight, m.desired, m.ready, _num(m.load), _num(m.target)))
            totals[0] += m.inflight
            totals[1] += m.desired
            totals[2] += m.ready
        self._put(self._fleet, i, fleet_w, span, (totals[0], totals[1], totals[2], _NAN, _NAN))
        for name, series in list(self._series.items()):
            if name in sampled:
                continue
            for col in series.values():
                col[i] = _NAN
            if all(math.isnan(v) for v in series["desired"]):
                del self._series[name]      # gone from the catalog an hour ago: nothing left to show
        self._head = (i + 1) % self.points
        self._count = min(self.points, self._count + 1)
        self.version += 1

    @staticmethod
    def _put(series: Mapping[str, array[float]], i: int, w: _Window, span: float,
             state: tuple[float, float, float, float, float]) -> None:
        series["requests"][i] = w.requests / span
        series["errors"][i] = w.errors / span
        series["ttft_p50"][i] = w.percentile(0.50)
        series["ttft_p99"][i] = w.percentile(0.99)
        series["tokens_in"][i] = w.tokens_in / span
        series["tokens_out"][i] = w.tokens_out / span
        for name, value in zip(("inflight", "desired", "ready", "load", "target"), state):
            series[name][i] = value

    def _order(self, since: float | None) -> list[int]:
        """Ring indices of the points held, oldest first, only those after `since`."""
        start = (self._head - self._count) % self.points
        idx = [(start + k) % self.points for k in range(self._count)]
        if since is not None:
            # Compared as answers spell them (to the millisecond): `since` is a `t` of an earlier answer.
            idx = [i for i in idx if round(self._t[i], 3) > since]
        return idx

    def models(self) -> list[str]:
        return sorted(self._series)

    def to_dict(self, model: str | None = None, since: float | None = None, first: int | None = None) -> dict[str, Any]:
        """The JSON of GET /api/v1/history (KeyError for a model with no series); `first`: only the
        first that many models by name (what the console's stream carries)."""
        idx = self._order(since)
        names = [model] if model is not None else sorted(self._series)[:first]
        if model is not None and model not in self._series:
            raise KeyError(model)
        return {"interval": self.interval, "points": self.points, "fields": list(FIELDS),
                "t": [round(self._t[i], 3) for i in idx],
                "fleet": _columns(self._fleet, idx),
                "models": {n: _columns(self._series[n], idx) for n in names}}


def _num(v: float | None) -> float:
    return _NAN if v is None else float(v)


def _columns(series: Mapping[str, array[float]], idx: list[int]) -> dict[str, list[float | None]]:
    # Four significant digits are more than a chart shows, and keep the answer short.
    out: dict[str, list[float | None]] = {}
    for name, col in series.items():
        values = [col[i] for i in idx]
        out[name] = [None if math.isnan(v) else float(f"{v:.4g}") for v in values]
    return out
