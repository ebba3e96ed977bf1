"""Normal traffic beside a hostile engine and hostile clients, against the same traffic alone, in one run.

    python3 -m bench.hostile [--quiet 15] [--hostile 30] [--after 10] [--concurrency 4]

Starts `llmgwctl serve` (local agent, fake engines) on 127.0.0.1 with one
well-behaved model, `good`, and measures four phases from an aiohttp client
in this process:

  quiet    normal traffic alone: non-stream chats to `good` from
           --concurrency clients, each pausing 20 ms between requests, and
           GET /healthz on both ports every 50 ms
  engines  the same, while a second catalog file adds models whose fake
           engines misbehave (`llmgwctl engine fake --fault/--metrics-fault`):
           a 10 GB Content-Length, a body without end, header lines without
           end, a header growing without end, headers never sent, a
           redirect, a /metrics page of a million series, one of 100 MB, and
           a redirecting one; --hostile-clients clients, in a process of
           their own, keep sending requests to each of them
  clients  the same, and those clients also send a 30 MB model name, a JSON
           body of 1,000,000 keys and a gzip body inflating to the router's
           cap, over and over
  after    the hostile traffic stopped and the hostile models removed: does
           serve's memory come back

The misbehaving engines and `bulk`, the model the hostile clients' bodies
name, run on a second agent at a lower CPU priority (they stand for engines
on other machines; --engines-local runs them beside `good` on serve's own
agent), and the hostile clients in a process of their own (--same-process:
on the measuring client's loop).

Printed per phase: normal requests' p50/p99 and errors, /healthz's worst
latency, serve's RSS (peak and at the end); then the ratios against the quiet
phase and what status says about the hostile replicas.
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from tests.httptarget import CountingTarget
from tests.procs import free_port

if TYPE_CHECKING:
    import aiohttp  # loaded where a phase runs

# A hostile request: its path, its body and its headers.
Body = tuple[str, bytes, dict[str, str]]

# `bulk` is what the hostile clients name: a model of its own, so what is
# measured is what their bodies cost the router, not what parsing them costs
# the engine behind `good` (a fake engine reads every body on its one loop).
#
# Pools. `good` runs on serve's local agent (pool `serve`). The hostile
# engines and `bulk` run on a second agent, pool `far`, started at a lower
# CPU priority (`nice`, which its engines inherit): in a fleet they run on
# other machines, and on this bench's 2 cores, at equal priority, the CPU
# they burn producing a million series or parsing a million keys is taken
# from serve and from normal traffic's own engine, which is not what the
# bench is for. --engines-local puts them all on serve's agent, as before.
def catalogs(local: bool) -> str:
    good, far = ("", "") if local else (", pool: serve", ", pool: far")
    return ("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"
            f"  - name: good\n    replicas: 1\n    profiles: [{{name: cpu, engine: fake, gpus: 0{good}}}]\n"
            f"  - name: bulk\n    replicas: 1\n    profiles: [{{name: cpu, engine: fake, gpus: 0{far}}}]\n")
CHAT = json.dumps({"model": "good", "messages": [{"role": "user", "content": "Hello! How are you today?"}],
                   "max_tokens": 16}).encode()


def hostile_catalog(redirect_to: str, local: bool) -> tuple[str, list[str], list[str]]:
    """The catalog of misbehaving models; the models whose answers and whose pages are hostile."""
    answers = {"huge": "huge-length", "endless": "endless-body", "headers": "endless-headers",
               "grow": "growing-header", "silent": "no-headers", "redirect": "redirect"}
    pages = {"series": "many-series", "page": "huge-page", "metrics-redirect": "redirect"}
    far = "" if local else "pool: far, "
    text = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"
    for name, fault in answers.items():
        text += (f"  - name: {name}\n    replicas: 1\n    profiles: [{{name: cpu, engine: fake, gpus: 0, {far}"
                 f"args: ['--fault', '{fault}', '--redirect-to', '{redirect_to}']}}]\n")
    for name, fault in pages.items():
        text += (f"  - name: {name}\n    replicas: 1\n    profiles: [{{name: cpu, engine: fake, gpus: 0, {far}"
                 f"args: ['--metrics-fault', '{fault}', '--redirect-to', '{redirect_to}']}}]\n")
    return text, list(answers), list(pages)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Phase:
    def __init__(self, name: str):
        self.name = name
        self.latencies: list[float] = []
        self.errors = 0
        self.health_max = 0.0
        self.health_n = 0
        self.rss_peak = 0.0
        self.rss_end = 0.0
        self.hostile_sent = 0


async def normal(session: aiohttp.ClientSession, url: str, stop: float, phase: Phase) -> None:
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=CHAT, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                ok = r.status == 200
        except Exception:  # noqa: BLE001 -- whatever fails a request, the bench counts it as an error
            ok = False
        if ok:
            phase.latencies.append(time.perf_counter() - t0)
        else:
            phase.errors += 1
        await asyncio.sleep(0.02)


async def health(session: aiohttp.ClientSession, urls: tuple[str, ...], stop: float, phase: Phase) -> None:
    while time.perf_counter() < stop:
        for url in urls:
            t0 = time.perf_counter()
            try:
                async with session.get(url) as r:
                    await r.read()
            except Exception:  # noqa: BLE001 -- only the time a probe took is measured, whatever it met
                pass
            phase.health_max = max(phase.health_max, time.perf_counter() - t0)
            phase.health_n += 1
        await asyncio.sleep(0.05)


async def memory(pid: int, stop: float, phase: Phase) -> None:
    while time.perf_counter() < stop:
        phase.rss_peak = max(phase.rss_peak, rss_mb(pid))
        await asyncio.sleep(0.2)
    phase.rss_end = rss_mb(pid)


async def hostile(session: aiohttp.ClientSession, router: str, bodies: list[Body], stop: float, phase: Phase) -> None:
    """One client going round the hostile requests: to misbehaving engines, and with hostile bodies."""
    import aiohttp
    i = 0
    while time.perf_counter() < stop:
        path, body, headers = bodies[i % len(bodies)]
        i += 1
        try:
            async with session.post(router + path, data=body, headers=headers, allow_redirects=False,
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
        except Exception:  # noqa: BLE001 -- hostile requests are meant to fail; only sending them counts
            pass
        phase.hostile_sent += 1
        await asyncio.sleep(0.05)


def hostile_bodies(answers: list[str], pages: list[str]) -> list[Body]:
    json_h = {"Content-Type": "application/json"}
    return [("/v1/chat/completions", json.dumps({"model": m, "messages": [{"role": "user", "content": "x"}]}).encode(),
             json_h) for m in answers + pages]


def hostile_client_bodies(max_body: int) -> list[Body]:
    json_h = {"Content-Type": "application/json"}
    out: list[Body] = []
    # A 30 MB model name, under the 32 MiB body cap.
    out.append(("/v1/chat/completions", b'{"model": "' + b"m" * 30_000_000 + b'", "messages": []}', json_h))
    # 1,000,000 keys, about 17 MB, naming a real model (by its canonical name).
    keys = b",".join(b'"k%d":0' % i for i in range(1_000_000))
    out.append(("/v1/chat/completions", b'{"model":"bulk","messages":[{"role":"user","content":"x"}],' + keys + b"}",
                json_h))
    # A gzip body that inflates to just under the cap.
    pad = max_body - 100
    raw = b'{"model":"bulk","messages":[{"role":"user","content":"x"}],"pad":"' + b" " * pad + b'"}'
    out.append(("/v1/chat/completions", gzip.compress(raw, 9), {**json_h, "Content-Encoding": "gzip"}))
    return out


async def run_phase(name: str, seconds: float, args: argparse.Namespace, router: str, control: str, pid: int,
                    hostile_kinds: HostileKinds | None = None) -> Phase:
    import aiohttp
    phase = Phase(name)
    stop = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=60)
    # The hostile clients are other parties: in their own process, so what
    # sending 30 MB bodies costs them is not counted in normal traffic's
    # latencies (the client that measures is on the same 2 cores already).
    # --same-process puts them back on the measuring client's loop.
    others = None
    if hostile_kinds is not None and not args.same_process:
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        others = ctx.Process(target=hostile_process, args=(router, hostile_kinds, args.hostile_clients, seconds, theirs))
        others.start()
    async with aiohttp.ClientSession(timeout=timeout) as s, aiohttp.ClientSession(timeout=timeout) as h:
        tasks = [normal(s, router + "/v1/chat/completions", stop, phase) for _ in range(args.concurrency)]
        tasks.append(health(h, (router + "/healthz", control + "/healthz"), stop, phase))
        tasks.append(memory(pid, stop, phase))
        if hostile_kinds is not None and others is None:
            tasks.append(hostile_clients(router, build_bodies(hostile_kinds), args.hostile_clients, stop, phase))
        await asyncio.gather(*tasks)
    if others is not None:
        if mine.poll(seconds + 60):
            phase.hostile_sent = mine.recv()
        others.join(30)
        if others.is_alive():
            others.kill()
    return phase


async def hostile_clients(router: str, bodies: list[Body], n: int, stop: float, phase: Phase) -> None:
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as bad:
        await asyncio.gather(*(hostile(bad, router, bodies[k::n], stop, phase) for k in range(n)))


def hostile_process(router: str, kinds: HostileKinds, n: int, seconds: float, conn: Any) -> None:
    """The hostile clients' process: `n` clients going round their requests for `seconds`; sends how many went."""
    import uvloop
    phase = Phase("hostile")
    bodies = build_bodies(kinds)
    uvloop.run(hostile_clients(router, bodies, n, time.perf_counter() + seconds, phase))
    conn.send(phase.hostile_sent)


# What the hostile clients send: requests to the misbehaving models (the
# names), and the hostile client bodies up to this body cap (None: none).
HostileKinds = tuple[list[str], int | None]


def build_bodies(kinds: HostileKinds) -> list[Body]:
    names, max_body = kinds
    return hostile_bodies(names, []) + (hostile_client_bodies(max_body) if max_body is not None else [])


def stop_engines_in(state_dir: str) -> None:
    """SIGKILL the process group of every process working in `state_dir` (the far agent's engines)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if cwd == state_dir or cwd.startswith(state_dir + os.sep):
            try:
                os.killpg(os.getpgid(int(entry)), signal.SIGKILL)
            except OSError:
                pass


def status(control: str) -> dict[str, Any]:
    import requests
    doc: dict[str, Any] = requests.get(control + "/api/v1/status", timeout=10).json()
    return doc


def wait_ready(control: str, n: int, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if len([r for r in status(control)["replicas"] if r["state"] == "ready"]) == n:
                return
        except Exception:  # noqa: BLE001 -- a controller still starting may answer anything; ask again until the deadline
            pass
        time.sleep(0.5)
    raise SystemExit(f"{n} replicas did not become ready in {seconds:g} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", type=float, default=15.0, help="seconds of normal traffic alone")
    ap.add_argument("--hostile", type=float, default=30.0, help="seconds with hostile engines and clients")
    ap.add_argument("--after", type=float, default=10.0, help="seconds after the hostile traffic stopped")
    ap.add_argument("--concurrency", type=int, default=4, help="normal clients")
    ap.add_argument("--hostile-clients", type=int, default=2, help="clients going round the hostile requests")
    ap.add_argument("--engines-local", action="store_true",
                    help="run every engine on serve's own agent at its priority (as before 2026-12-03)")
    ap.add_argument("--same-process", action="store_true",
                    help="run the hostile clients on the measuring client's loop (as before 2026-12-03)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="llmgw-hostile-")
    cat = os.path.join(tmp, "catalogs")
    os.mkdir(cat)
    with open(os.path.join(cat, "good.yaml"), "w") as f:
        f.write(catalogs(args.engines_local))
    target = CountingTarget()
    text, answers, pages = hostile_catalog(target.url + "/followed", args.engines_local)
    rport, cport = free_port(), free_port()
    router, control = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{cport}"
    base = 30000 + os.getpid() % 500 * 40
    log = open(os.path.join(tmp, "serve.log"), "wb")
    # Ten fake engines: more CPU replicas than a 2-core machine's local agent takes by default (8).
    serve = subprocess.Popen([sys.executable, "-m", "llmgwctl", "serve", "--catalogs", cat, "--listen",
                              f"127.0.0.1:{rport}", "--control", f"127.0.0.1:{cport}", "--state-dir",
                              os.path.join(tmp, "state"), "--ports", f"{base}-{base + 19}", "--max-cpu-replicas", "16", "--gpus", "none",
                              "--no-access-log", "--upstream-headers-timeout", "5", "--pool", "serve"],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    agent = None
    if not args.engines_local:
        agent = subprocess.Popen(["nice", "-n", "10", sys.executable, "-m", "llmgwctl", "agent", "--controller", control,
                                  "--node", "far", "--pool", "far", "--gpus", "none", "--state-dir",
                                  os.path.join(tmp, "state-far"), "--ports", f"{base + 20}-{base + 39}",
                                  "--max-cpu-replicas", "16"],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    import uvloop
    try:
        wait_ready(control, 2)
        from llmgwctl.router.config import DEFAULTS
        names = answers + pages
        quiet = uvloop.run(run_phase("quiet", args.quiet, args, router, control, serve.pid))
        with open(os.path.join(cat, "hostile.yaml"), "w") as f:
            f.write(text)
        wait_ready(control, 2 + len(answers) + len(pages))
        bad = uvloop.run(run_phase("engines", args.hostile, args, router, control, serve.pid, (names, None)))
        rows = status(control)["replicas"]
        both = uvloop.run(run_phase("clients", args.hostile, args, router, control, serve.pid, (names, DEFAULTS.max_body_bytes)))
        os.unlink(os.path.join(cat, "hostile.yaml"))
        after = uvloop.run(run_phase("after", args.after, args, router, control, serve.pid))
    finally:
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
        # An agent that stops leaves its engines running, for the next one to
        # adopt; `bulk`'s would outlive the bench (serve stops its own).
        stop_engines_in(os.path.join(tmp, "state-far"))
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
        target.close()
        log.close()

    where = ("every engine on serve's agent" if args.engines_local
             else "hostile engines and bulk on an agent at nice 10")
    clients_where = "on the measuring loop" if args.same_process else "in their own process"
    print(f"{os.cpu_count()} CPUs shared by the client, serve and 1-10 fake engines ({where}; hostile clients "
          f"{clients_where}); normal traffic: {args.concurrency} clients, 20 ms apart\n")
    hdr = (f"{'phase':<9}{'normal req':>11}{'errors':>8}{'p50 ms':>8}{'p99 ms':>8}{'health max ms':>15}"
           f"{'RSS peak MB':>13}{'RSS end MB':>12}{'hostile req':>13}")
    print(hdr)
    print("-" * len(hdr))
    for p in (quiet, bad, both, after):
        print(f"{p.name:<9}{len(p.latencies):>11}{p.errors:>8}{pct(p.latencies, 0.5) * 1e3:>8.2f}"
              f"{pct(p.latencies, 0.99) * 1e3:>8.2f}{p.health_max * 1e3:>15.1f}{p.rss_peak:>13.0f}"
              f"{p.rss_end:>12.0f}{p.hostile_sent:>13}")
    q99 = pct(quiet.latencies, 0.99)
    for p in (bad, both):
        p99 = pct(p.latencies, 0.99)
        print(f"\n{p.name} vs quiet: p99 {p99 / q99:.2f}x ({p99 * 1e3:.1f} ms; target <= 2x and < 100 ms), "
              f"RSS peak {p.rss_peak - quiet.rss_peak:+.0f} MB (target < 200), "
              f"/health worst {p.health_max * 1e3:.1f} ms (target < 100)")
    print(f"after: RSS {after.rss_end - quiet.rss_end:+.0f} MB against quiet; "
          f"redirect target hit {len(target.hits)} times (target 0)")
    print("\nwhat status said about the hostile replicas:")
    for r in rows:
        if r["model"] not in ("good", "bulk"):
            print(f"  {r['model']:<17} {r['id']:<10} {r.get('router') or '-'}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
