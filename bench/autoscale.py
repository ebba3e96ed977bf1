"""Autoscaling under an open-loop ramp, against a fleet fixed at max and one fixed at min, in the same run.

One real `llmgwctl serve` on 127.0.0.1 (its local agent, fake engines only)
serves three models that differ only in their replica counts:

  auto       replicas {min, max} with an autoscale policy (inflight, target per replica, short window)
  fixed-max  replicas = max: the latency floor, and the replica-seconds to beat
  fixed-min  replicas = min: what no scaling costs in latency

Every replica is `llmgwctl engine fake` with a start-up delay (as a real engine
loads weights), a batch limit (--max-num-seqs: more requests queue) and a
token rate. The load is open loop: Poisson arrivals (the same schedule, from
one seed, for each model) at a base rate, ramping up to `factor` times it,
holding, ramping back down, then a tail at the base rate. Each request streams
and its TTFT is the time until its first generated token reaches the client,
queueing included.

It prints the replicas of each model over time, TTFT p99 per phase, the time
the auto model took to reach the count the hold needs (from the end of the
ramp up), replica-seconds (starting replicas included: they hold a GPU), and
flaps (a down-step followed by an up-step within the stable window), then the
targets of issue 17 as ratios. Bounded: at most --max-requests per model and
the phases' total time plus start-up; about 2.5 minutes with the defaults.

    python3 -m bench.autoscale [--startup-delay 4] [--base-rate 1] [--factor 10] [--seed 1]
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import aiohttp

from tests.procs import free_port

from . import REPO

MODELS = ("auto", "fixed-max", "fixed-min")
PHASES = ("base", "up", "hold", "down", "tail")
# The reconciler passes once a second and the router polls engines once a
# second (llmgwctl.reconciler.TICK, RouterConfig.poll_interval): "2 poll
# intervals" in the targets is 2 s.
POLL = 1.0

# Each phase: its name, when it starts and when it ends (seconds from the start).
Bounds = list[tuple[str, float, float]]
# One request: when it was sent, its TTFT (None: it failed), its whole duration, whether it succeeded.
Result = tuple[float, float | None, float, bool]
# One status read: when, the model, its desired and ready replicas, the replicas it holds.
Sample = tuple[float, str, int, int, int]


def catalog(args: argparse.Namespace) -> str:
    engine = (f'["--startup-delay", "{args.startup_delay}", "--max-num-seqs", "{args.batch}", '
              f'"--tokens-per-second", "{args.tokens_per_second}", "--ttft", "{args.ttft}"]')
    profile = f"    profiles: [{{name: cpu, engine: fake, gpus: 0, args: {engine}}}]\n"
    return ("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"
            f"  - name: auto\n    replicas: {{min: {args.min}, max: {args.max}}}\n"
            f"    autoscale: {{metric: inflight, target: {args.target}, scale_down_window: {args.window}s, "
            f"max_step: {args.max_step}}}\n" + profile +
            f"  - name: fixed-max\n    replicas: {args.max}\n" + profile +
            f"  - name: fixed-min\n    replicas: {args.min}\n" + profile)


def phase_bounds(args: argparse.Namespace) -> Bounds:
    out: Bounds = []
    t = 0.0
    for name, length in zip(PHASES, (args.base, args.ramp, args.hold, args.ramp, args.tail)):
        out.append((name, t, t + length))
        t += length
    return out


def rate_at(t: float, args: argparse.Namespace, bounds: Bounds) -> float:
    lo, hi = args.base_rate, args.base_rate * args.factor
    for name, start, end in bounds:
        if start <= t < end:
            x = (t - start) / (end - start)
            rate: float = {"base": lo, "up": lo + (hi - lo) * x, "hold": hi, "down": hi - (hi - lo) * x, "tail": lo}[name]
            return rate
    return 0.0


def schedule(args: argparse.Namespace, bounds: Bounds) -> list[float]:
    """Poisson arrival times with the ramp's rate (thinning), the same for every model."""
    rng = random.Random(args.seed)
    peak, end, t = args.base_rate * args.factor, bounds[-1][2], 0.0
    out: list[float] = []
    while len(out) < args.max_requests:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() < rate_at(t, args, bounds) / peak:
            out.append(t)
    return out


def phase_of(t: float, bounds: Bounds) -> str:
    return next((name for name, start, end in bounds if start <= t < end), PHASES[-1])


def has_token(buf: bytes) -> bool:
    """Whether an SSE buffer holds a chunk with generated text (not the role-only opening chunk, not [DONE])."""
    for line in buf.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
        except (ValueError, KeyError, IndexError):
            continue
        if delta.get("content"):
            return True
    return False


async def one(session: aiohttp.ClientSession, url: str, model: str, args: argparse.Namespace) -> tuple[float | None, float, bool]:
    """(TTFT or None on failure, whole duration, ok).

    TTFT is when the first generated token reaches this client: the role-only
    chunk vLLM (and the fake) open a stream with is not a token, and a chunk
    boundary may split an event, so events are parsed from the stream's lines.
    """
    t0 = time.monotonic()
    first = None
    try:
        async with session.post(url, json={"model": model, "stream": True, "max_tokens": args.tokens,
                                           "messages": [{"role": "user", "content": "go"}]},
                                timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as resp:
            if resp.status != 200:
                await resp.read()
                return None, time.monotonic() - t0, False
            pending = b""
            async for chunk in resp.content.iter_any():
                if first is None:
                    pending += chunk
                    complete, _, pending = pending.rpartition(b"\n")
                    if has_token(complete):
                        first = time.monotonic() - t0
            return first, time.monotonic() - t0, first is not None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None, time.monotonic() - t0, False


async def drive(router: str, model: str, arrivals: list[float], start: float, args: argparse.Namespace,
                results: list[Result]) -> None:
    url = router + "/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = []

        async def timed(at: float) -> None:
            results.append((at, *await one(session, url, model, args)))

        for at in arrivals:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(timed(at)))
        await asyncio.gather(*tasks)


async def watch(control: str, start: float, end: float, samples: list[Sample]) -> None:
    """Every 0.5 s: per model, (t, desired, ready, replicas held) from the control API's status."""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            try:
                async with session.get(control + "/api/v1/status", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    status = await resp.json()
                t = time.monotonic() - start
                for m in status["models"]:
                    held = sum(r["model"] == m["name"] and r["state"] != "stopping" for r in status["replicas"])
                    samples.append((t, m["name"], m["desired"], m["ready"], held))
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
                pass
            await asyncio.sleep(0.5)


def status(control: str) -> dict[str, Any]:
    import urllib.request
    with urllib.request.urlopen(control + "/api/v1/status", timeout=5) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


def wait_ready(control: str, want: dict[str, int], proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        try:
            models = {m["name"]: m["ready"] for m in status(control)["models"]}
            if all(models.get(k, 0) >= v for k, v in want.items()):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"replicas not ready within {timeout:.0f} s: {want}")


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


def series(samples: list[Sample], model: str, col: Literal[2, 3, 4]) -> list[tuple[float, int]]:
    return [(s[0], s[col]) for s in samples if s[1] == model]


def replica_seconds(points: list[tuple[float, int]], end: float) -> float:
    total = 0.0
    for (t, n), (t2, _) in zip(points, points[1:] + [(end, 0)]):
        total += n * (min(t2, end) - t) if t < end else 0
    return total


def flaps(points: list[tuple[float, int]], window: float) -> int:
    """Down-steps of the wanted count followed by an up-step within `window` seconds."""
    steps, prev = [], None
    for t, n in points:
        if prev is not None and n != prev:
            steps.append((t, n - prev))
        prev = n
    return sum(1 for i, (t, d) in enumerate(steps) if d < 0
               and any(d2 > 0 and t2 - t <= window for t2, d2 in steps[i + 1:]))


def fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--startup-delay", type=float, default=4.0, help="fake engine start-up (s)")
    ap.add_argument("--batch", type=int, default=4, help="fake engine --max-num-seqs")
    ap.add_argument("--tokens-per-second", type=float, default=40.0)
    ap.add_argument("--ttft", type=float, default=0.05, help="fake engine TTFT once a slot is free (s)")
    ap.add_argument("--tokens", type=int, default=20, help="max_tokens per request")
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--max", type=int, default=6)
    # 1.5: the operating point of this workload, batch and start-up. The
    # sweep of bench/autoscale_model.py puts it on a plateau 1.45-1.6 (all
    # four of issue 17's targets on 70-76 % of seeds, lower loses the needed
    # count, higher the latency), and on the machine 1.5 beat 1.45
    # (bench/README.md, "Fourth pass").
    ap.add_argument("--target", type=float, default=1.5, help="in flight per replica (the operating point: README)")
    ap.add_argument("--max-step", type=int, default=2)
    ap.add_argument("--window", type=float, default=20.0, help="scale_down_window (s)")
    ap.add_argument("--base-rate", type=float, default=1.0, help="requests/s per model at the base")
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--base", type=float, default=15.0, help="phase lengths (s)")
    ap.add_argument("--ramp", type=float, default=10.0)
    ap.add_argument("--hold", type=float, default=30.0)
    ap.add_argument("--tail", type=float, default=35.0)
    ap.add_argument("--max-requests", type=int, default=1000, help="per model")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dump", type=Path, help="also write every request's (arrival, TTFT, duration, ok), the "
                    "replica samples and the scaling events to this JSON file, for a closer look")
    args = ap.parse_args()

    bounds = phase_bounds(args)
    arrivals = schedule(args, bounds)
    end = bounds[-1][2]
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-autoscale-"))
    (tmp / "catalogs").mkdir()
    (tmp / "catalogs" / "models.yaml").write_text(catalog(args))
    router_port, control_port = free_port(), free_port()
    base = random.Random().randrange(30000, 39000, 100)
    router, control = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{control_port}"
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgwctl", "serve", "--catalogs", str(tmp / "catalogs"),
         "--listen", f"127.0.0.1:{router_port}", "--control", f"127.0.0.1:{control_port}",
         "--state-dir", str(tmp / "state"), "--ports", f"{base}-{base + 99}", "--gpus", "none", "--settle", "1"],
        # `python -m` puts the working directory first on sys.path, ahead of
        # PYTHONPATH: run from the tree this bench is in, so it measures that
        # tree's llmgwctl wherever it is started from (a snapshot's bench run
        # from a worktree ran the worktree's code).
        cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(control, {"auto": args.min, "fixed-max": args.max, "fixed-min": args.min}, proc)
        print(f"{len(arrivals)} requests per model over {end:.0f} s: base {args.base_rate:g}/s, "
              f"x{args.factor:g} for {args.hold:.0f} s; engines: start-up {args.startup_delay:g} s, "
              f"batch {args.batch}, {args.tokens} tokens at {args.tokens_per_second:g}/s", flush=True)
        results: dict[str, list[Result]] = {m: [] for m in MODELS}
        samples: list[Sample] = []

        async def run() -> None:
            start = time.monotonic()
            await asyncio.gather(watch(control, start, start + end + 5, samples),
                                 *(drive(router, m, arrivals, start, args, results[m]) for m in MODELS))

        asyncio.run(run())
        events = [e for e in status(control)["events"] if e["kind"] in ("scale-up", "scale-down")]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    report(args, bounds, end, results, samples, events)
    shutil.rmtree(tmp, ignore_errors=True)     # kept when the run failed: serve.log is there
    if args.dump:
        args.dump.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "samples": samples, "events": events}))


def report(args: argparse.Namespace, bounds: Bounds, end: float, results: dict[str, list[Result]],
           samples: list[Sample], events: list[dict[str, Any]]) -> None:
    hold_start, hold_end = bounds[2][1], bounds[2][2]
    # What the hold needs: its arrival rate times the fixed-max fleet's mean
    # request time (Little's law), over the target in flight per replica.
    fm_hold = [r for r in results["fixed-max"] if hold_start <= r[0] < hold_end and r[3]]
    service = sum(r[2] for r in fm_hold) / max(len(fm_hold), 1)
    needed = min(args.max, max(args.min, math.ceil(args.base_rate * args.factor * service / args.target - 1e-9)))

    print("\nreplicas held (desired) every 5 s")
    print("t(s)   " + "  ".join(f"{m:>14}" for m in MODELS) + "   phase")
    for t in range(0, int(end) + 1, 5):
        row = []
        for m in MODELS:
            pts = [s for s in samples if s[1] == m]
            i = bisect.bisect_right([s[0] for s in pts], t) - 1
            row.append(f"{pts[i][4]:>9} ({pts[i][2]})" if i >= 0 else f"{'-':>14}")
        print(f"{t:>4}   " + "  ".join(f"{c:>14}" for c in row) + f"   {phase_of(t, bounds)}")

    print("\nTTFT p99 per phase (failed requests)")
    print("phase  " + "  ".join(f"{m:>16}" for m in MODELS))
    p99s = {}
    for name, start, stop in bounds:
        cells = []
        for m in MODELS:
            rs = [r for r in results[m] if start <= r[0] < stop]
            p = p99([r[1] for r in rs if r[3] and r[1] is not None])
            p99s[(m, name)] = p
            cells.append(f"{fmt(p)} ({sum(not r[3] for r in rs)})")
        print(f"{name:<6} " + "  ".join(f"{c:>16}" for c in cells))

    rsec = {m: replica_seconds(series(samples, m, 4), end) for m in MODELS}
    auto_ready = series(samples, "auto", 3)
    ramp_end = bounds[1][2]
    reached = next((t for t, n in auto_ready if t >= bounds[1][1] and n >= needed), None)
    flap_count = flaps(series(samples, "auto", 2), args.window)
    print(f"\nneeded during the hold: {needed} (rate {args.base_rate * args.factor:g}/s x mean request "
          f"{service:.2f} s / target {args.target:g})")
    print(f"auto reached {needed} ready at {fmt(reached)} ({fmt(None if reached is None else reached - ramp_end)} "
          f"after the ramp up ended)")
    print("replica-seconds: " + ", ".join(f"{m} {rsec[m]:.0f}" for m in MODELS))
    print(f"flaps (auto): {flap_count}")
    print("\nscaling events:")
    for e in events:
        print(f"  {e['kind']}: {e['message']}")

    hold_ratio = (p99s[("auto", "hold")] / p99s[("fixed-max", "hold")]
                  if p99s[("auto", "hold")] and p99s[("fixed-max", "hold")] else None)
    limit = args.startup_delay + 2 * POLL
    print("\ntargets (issue 17)")
    print(f"  hold TTFT p99 auto / fixed-max  {fmt(hold_ratio, 'x')}  (<= 1.5x)"
          f"   [fixed-min: {fmt(p99s[('fixed-min', 'hold')])}]")
    print(f"  replica-seconds auto / fixed-max {rsec['auto'] / rsec['fixed-max']:.2f}x  (<= 0.6x)")
    print(f"  flaps {flap_count}  (0)")
    print(f"  needed count after the ramp up  {fmt(None if reached is None else reached - ramp_end)}  "
          f"(<= start-up {args.startup_delay:g} s + 2 polls = {limit:g} s)")


if __name__ == "__main__":
    main()
