"""Steady client load for the fault scenarios: a few threads streaming chat completions, every outcome kept.

Beside it, `Sampler`: one thread reading a value (a catalog version, a
router's endpoint count) every few milliseconds while a scenario runs.

A request counts as good only if it was answered 200 and its stream ended
with `data: [DONE]` and carried no error event: a stream cut short by a
failure is exactly what the suite is here to catch. Each worker is bounded
by its own request timeout, and `stop()` by a deadline.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests

from ..support import wait_until


@dataclass(frozen=True, slots=True)
class Outcome:
    model: str
    started: float          # time.monotonic()
    ended: float
    ok: bool
    detail: str             # status code and the tail of what went wrong; "" when ok
    replica: str = ""


def stream_once(session: requests.Session, url: str, model: str, *, max_tokens: int = 6,
                timeout: float = 30.0) -> Outcome:
    started = time.monotonic()
    try:
        with session.post(url + "/v1/chat/completions", stream=True, timeout=timeout,
                          json={"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                                "messages": [{"role": "user", "content": "steady"}]}) as resp:
            body = b"".join(resp.iter_content(None))
            replica = resp.headers.get("x-llmgw-replica", "")
            if resp.status_code != 200:
                return Outcome(model, started, time.monotonic(), False, f"{resp.status_code}: {body[:200]!r}", replica)
            if not body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body:
                return Outcome(model, started, time.monotonic(), False, f"broken stream: {body[-200:]!r}", replica)
            return Outcome(model, started, time.monotonic(), True, "", replica)
    except requests.RequestException as exc:
        return Outcome(model, started, time.monotonic(), False, f"{type(exc).__name__}: {exc}")


class SteadyLoad:
    """`workers` threads, each streaming to `models` in turn until `stop()`."""

    def __init__(self, url: str, models: list[str], *, workers: int = 4, max_tokens: int = 6, pause: float = 0.0):
        self.url, self.models, self.max_tokens, self.pause = url, list(models), max_tokens, pause
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)]

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _work(self, index: int) -> None:
        models = itertools.cycle(self.models[index % len(self.models):] + self.models[:index % len(self.models)])
        with requests.Session() as session:
            while not self._stop.is_set():
                outcome = stream_once(session, self.url, next(models), max_tokens=self.max_tokens)
                with self._lock:
                    self.outcomes.append(outcome)
                if self.pause:
                    self._stop.wait(self.pause)

    def stop(self, timeout: float = 60.0) -> list[Outcome]:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a load worker did not finish its last request"
        return self.outcomes

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Block until at least `count` more requests have finished (so a phase really ran under load)."""
        with self._lock:
            target = len(self.outcomes) + count

        def done() -> bool:
            with self._lock:
                return len(self.outcomes) >= target
        wait_until(done, f"load to make progress: {count} more requests finished", timeout)

    def since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.started >= t]

    def failures(self, outcomes: list[Outcome] | None = None) -> list[Outcome]:
        return [o for o in (self.outcomes if outcomes is None else outcomes) if not o.ok]


class Sampler:
    """Reads `read(session)` every `every` seconds on a thread while its `with` block runs; the readings in `seen`.

    A read that fails as a server going away fails (no answer, not JSON, no
    such field) is kept as `failed`, or skipped when `failed` is `SKIP`. With
    `changes_only`, a reading equal to the one before is not kept again.
    """

    SKIP = object()

    def __init__(self, read: Callable[[requests.Session], Any], every: float, *, failed: Any = SKIP,
                 changes_only: bool = False):
        self.seen: list[Any] = []
        self._read, self._every, self._failed, self._changes_only = read, every, failed, changes_only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with requests.Session() as session:
            while not self._stop.wait(self._every):
                try:
                    value = self._read(session)
                except (requests.RequestException, ValueError, KeyError):
                    if self._failed is Sampler.SKIP:
                        continue
                    value = self._failed
                if not (self._changes_only and self.seen and self.seen[-1] == value):
                    self.seen.append(value)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def summary(outcomes: list[Outcome]) -> str:
    failed = [o for o in outcomes if not o.ok]
    return f"sent {len(outcomes)}, failed {len(failed)}"


def router_inflight(url: str) -> float:
    """Requests a router counts in flight, summed over its endpoints, from its /metrics."""
    text = requests.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmgw_router_inflight_requests{"))
