"""The control plane at fleet scale: a real `llmgwctl serve --no-local-agent` against a simulated fleet.

    python3 -m bench.fleet --nodes 500 [--routers 50] [--heartbeat 10] [--steady 30] [--calls 50] [--restart]
                          [--no-changes] [--routers-in-process]

The simulator (`tests/fleetsim.py`) runs in this process: NODES agents of 8
GPUs each, heartbeating every HEARTBEAT s on random phases and long-polling
their desired lists. ROUTERS standalone routers follow the watch stream in a
process of their own (`RouterProcess`; with --routers-in-process on the
agents' loop, as before): in a real fleet they are other machines, and on
the agents' loop every router's clock also carried the simulator's lag. The
controller is its own process on loopback (no token), so its CPU and memory
are read from /proc/PID apart from the simulator's and the routers', which
are printed beside them (all share the machine's cores).

The catalog is sized to the fleet: 4 replicas of 1 GPU per node, half the
GPUs -- one model `big` with 1,000 replicas, the rest in MODELS models -- so a
change has room. What it prints, in order:

  converge     catalog loaded -> every replica ready in the simulator and on every router
  steady       controller CPU (of one core) with nothing changing, per heartbeat, passes/s
  status       GET /api/v1/status latency (p50/p90/p99/max of CALLS, from another process as `llmgwctl
               status` asks); healthz before it (the baseline: what any answer waits on serve's loop),
               metrics after it: the same for GET /metrics
  memory       controller RSS, and per node over the RSS before any agent came
  add          100 models x 2 replicas written: -> desired on every affected node, -> every router
  remove       the 100 removed: -> desired without them, -> gone from every router
  profile      big's args changed (1,000 replicas replaced): -> desired with the new spec, -> every router
  restart      SIGKILL and start again: settled, every router whole again; starts/stops caused (must be 0)

"-> router" is measured twice: from the catalog write, and from the moment a
replica turned ready on its (simulated) node to the moment each router held
it, which leaves out the simulator's start delay.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from llmgwctl.contracts import ReplicaSpec
from tests.fleetsim import ENGINE_YAML, RouterView, SimAgent, SimFleet, SimReplica
from tests.procs import free_port

from . import REPO

TICKS = os.sysconf("SC_CLK_TCK")
BIG = 1000          # big's replicas: "one profile changed for 1,000 replicas"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS      # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def model_yaml(name: str, replicas: int, args: tuple[str, ...] = ()) -> str:
    extra = f"        args: [{', '.join(args)}]\n" if args else ""
    return (f"  - name: {name}\n    source: sim/{name}\n    replicas: {replicas}\n    profiles:\n"
            f"      - name: p\n        engine: sim\n        gpus: 1\n{extra}")


def write(directory: Path, name: str, text: str | None) -> None:
    path = directory / name
    if text is None:
        path.unlink()
        return
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    tmp.rename(path)        # atomic: the watcher never reads half a file


def catalog(models: list[str]) -> str:
    return "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n" + "".join(models)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ms(values: list[float]) -> str:
    return f"p50 {pct(values, 0.5) * 1000:7.0f} ms  p99 {pct(values, 0.99) * 1000:7.0f} ms  (n={len(values)})"


class GcPauses:
    """This process's garbage collections: the longest pause, and how many were full (gen 2)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.full = 0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.longest = max(self.longest, time.perf_counter() - self._started)
        self.full += info["generation"] == 2


GC_PAUSES = GcPauses()


class LoopLag:
    """How late this process's loop runs a 10 ms timer: the simulator's own delay in what it
    stamps (a replica turning ready) and sends (its report), which a phase's figures include."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            due = loop.time() + 0.01
            await asyncio.sleep(0.01)
            self.lags.append(loop.time() - due)

    def take(self) -> str:
        lags, self.lags = self.lags, []
        return f"p99 {pct(lags, 0.99) * 1000:.0f} ms, max {max(lags, default=0) * 1000:.0f} ms" if lags else "-"


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="llmgw-fleet-"))
        self.catalogs = self.dir / "catalogs"
        self.catalogs.mkdir()
        self.control = free_port()
        self.listen = free_port()
        self.url = f"http://127.0.0.1:{self.control}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.passed = False
        self.lag = LoopLag()
        self.fleet = SimFleet(self.url, args.nodes, routers=args.routers, heartbeat=args.heartbeat,
                              router_process=not args.routers_in_process)
        total = 4 * args.nodes
        # big is 1,000 from 500 nodes up; a smaller fleet (a quick run) gets 2 per node.
        self.big: int = min(BIG, 2 * args.nodes)
        self.models: int = max(100, args.nodes // 5) if args.nodes >= 500 else max(1, args.nodes // 5)
        self.per_model = max(1, (total - self.big) // self.models)
        self.expected = self.big + self.models * self.per_model

    def start_serve(self) -> None:
        log = open(self.dir / "serve.log", "ab")
        # Every simulated agent reaches serve from 127.0.0.1 and holds a long-poll
        # there, plus the reports' shared pool and the routers: past the default
        # cap per address (4096) for a big fleet, as behind a NAT.
        # The node timeout and the settling window are three heartbeats, as
        # serve's defaults (15 s each) are for the agent's 5 s: with 10 s
        # heartbeats the defaults would call a node lost after one late report,
        # and end a restart's adoption before a slow node had reported once.
        hb = str(3 * self.args.heartbeat)
        extra = ["--control-connections-per-client", str(max(4096, 2 * self.args.nodes + 1024)),
                 "--node-timeout", hb, "--settle", hb, *(self.args.serve_arg or [])]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgwctl", "serve", "--no-local-agent", "--catalogs", str(self.catalogs),
             "--listen", f"127.0.0.1:{self.listen}", "--control", f"127.0.0.1:{self.control}", *extra],
            # From the tree this bench is in: `python -m` puts the working directory
            # ahead of PYTHONPATH, and a run started from another checkout measured that one.
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def serve(self) -> subprocess.Popen[bytes]:
        """serve's process, once start_serve has started it."""
        assert self.proc is not None, "serve is not started"
        return self.proc

    async def get(self, session: aiohttp.ClientSession, path: str) -> tuple[int, bytes]:
        async with session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            return resp.status, await resp.read()

    async def until(self, what: str, predicate: Callable[[], bool | Awaitable[bool]], timeout: float) -> float:
        started = time.monotonic()
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}; serve log: {self.dir}/serve.log")
            await asyncio.sleep(0.05)

    async def healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            return (await self.get(session, "/healthz"))[0] == 200
        except (aiohttp.ClientError, OSError):
            return False

    def ready_count(self) -> int:
        return sum(1 for _, r in self.fleet.running().values() if r.state.value == "ready")

    def routers_have(self, count: int) -> bool:
        return all(len(r.endpoints) == count for r in self.fleet.routers)

    async def metrics(self, session: aiohttp.ClientSession) -> tuple[float, float]:
        _, body = await self.get(session, "/metrics")
        total = count = 0.0
        for line in body.decode().splitlines():
            if line.startswith("llmgw_reconcile_pass_duration_seconds_sum"):
                total = float(line.split()[-1])
            elif line.startswith("llmgw_reconcile_pass_duration_seconds_count"):
                count = float(line.split()[-1])
        return count, total

    async def main(self) -> None:
        a = self.args
        base = [model_yaml("big", self.big)] + [model_yaml(f"m{i:04d}", self.per_model) for i in range(self.models)]
        write(self.catalogs, "engines.yaml", "apiVersion: llmgw/v1\nkind: Catalog\n" + ENGINE_YAML)
        write(self.catalogs, "base.yaml", catalog(base))
        print(f"fleet: {a.nodes} nodes x 8 GPUs, {a.routers} routers, heartbeat {a.heartbeat:g} s; "
              f"catalog: big x {self.big} + {self.models} models x {self.per_model} = {self.expected} replicas")
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            self.start_serve()
            await self.until("serve up", lambda: self.healthy(session), 60)
            rss_before = rss_mib(self.serve.pid)
            sim_cpu0, t0 = self_cpu(), time.monotonic()
            sim = asyncio.create_task(self.fleet.run(stop))
            lag = asyncio.create_task(self.lag.run(stop))
            try:
                took = await self.until("every replica ready", lambda: self.ready_count() == self.expected, a.timeout)
                took2 = await self.until("every router whole", lambda: self.routers_have(self.expected), a.timeout)
                print(f"converge     {took:6.1f} s to every replica ready; every router whole {took2:.1f} s later "
                      f"(from the first agent's start; agents start on random phases over {a.heartbeat:g} s)")
                # The simulator's own heap (5,000 agents' tasks, connections, replicas) is
                # left out of its full collections from here: each took this loop, which
                # stamps "ready" and sends the reports, for up to a second in a rollout.
                # The bench's process, not serve's (serve tunes its own GC).
                gc.freeze()
                await self.steady(session)
                await self.status()
                rss = rss_mib(self.serve.pid)
                print(f"memory       controller RSS {rss:.0f} MiB; {(rss - rss_before) * 1024 / a.nodes:.0f} KiB "
                      f"per node over the {rss_before:.0f} MiB before any agent")
                if not a.no_changes:
                    # And no collection at all while the changes are timed: a full one still took this
                    # loop for up to 1.35 s in a rollout (5,000 agents' new specs and replicas), and the
                    # replicas it stamps ready, and their reports, waited behind it. Minutes of cycles
                    # left uncollected cost this process some memory; serve keeps its own GC.
                    gc.disable()
                    try:
                        await self.changes(base)
                    finally:
                        gc.enable()
                if a.restart:
                    await self.restart(session)
                self.passed = True
            finally:
                routers_cpu = self.routers_cpu()
                sim_cpu, wall = self_cpu() - sim_cpu0, time.monotonic() - t0
                stop.set()
                await asyncio.wait({sim, lag}, timeout=15)
                rp = self.fleet.router_process
                print(f"simulator    {sim_cpu / wall:.2f} of a core over the run (this process: agents"
                      f"{'' if rp else ' and routers'}); "
                      + (f"routers {routers_cpu / wall:.2f} (their process; {rp.lines} lines applied here "
                         f"in {rp.busy:.1f} s, longest {rp.longest * 1000:.0f} ms); " if rp else "")
                      + f"longest GC pause here {GC_PAUSES.longest * 1000:.0f} ms of {GC_PAUSES.full} full; "
                      + f"errors: reports {self.fleet.report_errors} "
                      f"({', '.join(f'{n} {why}' for why, n in self.fleet.report_failures.most_common()) or 'none'}), "
                      f"polls {self.fleet.poll_errors}, "
                      f"watches {self.fleet.watch_failures()}")
                self.serve.send_signal(signal.SIGKILL)
                self.serve.wait()
                if self.passed:     # a failed run keeps its directory: the error names serve's log there
                    shutil.rmtree(self.dir, ignore_errors=True)

    def routers_cpu(self) -> float:
        """The router process's CPU seconds so far (0 with the routers on this loop)."""
        pid = self.fleet.router_process.pid if self.fleet.router_process else None
        try:
            return cpu_seconds(pid) if pid else 0.0
        except OSError:
            return 0.0

    async def steady(self, session: aiohttp.ClientSession) -> None:
        a = self.args
        await asyncio.sleep(a.heartbeat)        # let the last changes' reports settle out
        passes0, pass_s0 = await self.metrics(session)
        reports0 = sum(x.reports for x in self.fleet.agents)
        cpu0, sim0, rt0, t0 = cpu_seconds(self.serve.pid), self_cpu(), self.routers_cpu(), time.monotonic()
        await asyncio.sleep(a.steady)
        cpu1, sim1, rt1, t1 = cpu_seconds(self.serve.pid), self_cpu(), self.routers_cpu(), time.monotonic()
        reports = sum(x.reports for x in self.fleet.agents) - reports0
        passes1, pass_s1 = await self.metrics(session)
        wall = t1 - t0
        passes = passes1 - passes0
        self.steady_rate = (cpu1 - cpu0) / wall       # of one core: the status phase's baseline
        print(f"steady       controller {(cpu1 - cpu0) / wall:.3f} of a core over {wall:.0f} s; "
              f"{reports / wall:.0f} reports/s -> {(cpu1 - cpu0) / max(reports, 1) * 1e6:.0f} us CPU per report; "
              f"{passes / wall:.2f} passes/s of {(pass_s1 - pass_s0) / max(passes, 1) * 1000:.1f} ms; "
              f"simulator {(sim1 - sim0) / wall:.2f} of a core"
              + (f", routers {(rt1 - rt0) / wall:.2f}" if self.fleet.router_process else ""))

    async def status(self) -> None:
        # From a process of its own (bench/get_times.py, plain requests as
        # `llmgwctl status` does), CALLS one after another. Measured on this
        # process's loop, every call also waited behind 5,000 agents' work
        # (status p90 347 ms here, 107 ms from curl in the same run): that
        # is the simulator, not the controller. /healthz first is the
        # baseline: what any answer waits on serve's loop now.
        # "CPU/call": serve's CPU over the calls less its steady rate over
        # that time, per call: what one answer costs the controller, however
        # long the client waited behind other work.
        calls = self.args.calls
        for path in ("/healthz", "/api/v1/status", "/metrics"):
            cpu0, t0 = cpu_seconds(self.serve.pid), time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.get_times", self.url + path, str(calls), cwd=REPO, stdout=subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 600)
            extra = cpu_seconds(self.serve.pid) - cpu0 - self.steady_rate * (time.monotonic() - t0)
            rows = [line.split() for line in out.decode().splitlines()]
            times = [float(r[0]) for r in rows]
            size = int(rows[-1][2]) if rows else 0
            bad = sum(1 for r in rows if r[1] != "200")
            label = {"/healthz": "healthz", "/metrics": "metrics"}.get(path, "status")
            if not times:
                print(f"{label:12s} no answer (GET {path})")
                continue
            print(f"{label:12s} p50 {pct(times, 0.5) * 1000:.0f} ms, p90 {pct(times, 0.9) * 1000:.0f} ms, "
                  f"p99 {pct(times, 0.99) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms; "
                  f"CPU/call ~{max(0.0, extra) / len(times) * 1000:.0f} ms ({size / 1e6:.1f} MB, GET {path}, "
                  f"n={len(times)}{f', {bad} not 200' if bad else ''}; another process)")

    async def phase(self, label: str, write_it: Callable[[], None],
                    desired_ok: Callable[[SimAgent, list[ReplicaSpec]], bool],
                    desired_done: Callable[[dict[str, float]], bool], router_ok: Callable[[RouterView], bool],
                    on_ready: Callable[[SimReplica], bool] | None = None) -> None:
        """Write a change; time it to each affected node's desired list and to each router.

        desired_ok(agent, specs): this answer is the change, on an affected node;
        desired_done(times): every affected node has had it; router_ok(router):
        this router holds the change; on_ready(replica): a replica of the change.
        """
        fleet = self.fleet
        desired_at: dict[str, float] = {}
        router_at: dict[int, float] = {}
        ready_at: dict[str, float] = {}
        seen: set[tuple[int, str]] = set()
        lags: list[float] = []

        def on_desired(agent: SimAgent, t: float, specs: list[ReplicaSpec]) -> None:
            if agent.name not in desired_at and desired_ok(agent, specs):
                desired_at[agent.name] = t

        def on_endpoints(router: RouterView, t: float) -> None:
            # Only the change's replicas are looked up: this runs in the simulator's loop for
            # every answer to every router, and walking 20,000 endpoints there delayed the
            # agents' reports, i.e. what is measured.
            for rid in [r for r in ready_at if r in router.endpoints]:
                if (router.index, rid) not in seen:
                    seen.add((router.index, rid))
                    lags.append(t - ready_at[rid])
            if router.index not in router_at and router_ok(router):
                router_at[router.index] = t

        def ready(agent: SimAgent, rep: SimReplica, t: float) -> None:
            if on_ready is not None and on_ready(rep):
                ready_at[rep.spec.id] = t

        fleet.on_desired, fleet.on_endpoints, fleet.on_ready = on_desired, on_endpoints, ready
        async with aiohttp.ClientSession() as session:
            passes0 = await self.metrics(session)
        self.lag.take()
        t0 = time.monotonic()
        write_it()
        try:
            await self.until(f"{label}: desired on every affected node", lambda: desired_done(desired_at),
                             self.args.timeout)
            await self.until(f"{label}: every router", lambda: len(router_at) == len(fleet.routers), self.args.timeout)
        finally:
            fleet.on_desired = lambda a, t, s: None
            fleet.on_endpoints = lambda r, t: None
            fleet.on_ready = lambda a, r, t: None
        print(f"{label:12s} desired: {ms([t - t0 for t in desired_at.values()])} from the write")
        print(f"{'':12s} routers: {ms([t - t0 for t in router_at.values()])} from the write")
        if lags:
            print(f"{'':12s} ready -> router: {ms(lags)} (replica ready on its node -> each router holds it)")
        simulated = self.lag.take()
        async with aiohttp.ClientSession() as session:
            passes1 = await self.metrics(session)
        n, total = passes1[0] - passes0[0], passes1[1] - passes0[1]
        print(f"{'':12s} serve: {n:.0f} passes of {total / max(n, 1) * 1000:.0f} ms mean in it; "
              f"the simulator's loop late by {simulated}")

    async def changes(self, base: list[str]) -> None:
        fleet = self.fleet
        added = {f"new{i:03d}" for i in range(100)}

        def new_running() -> int:
            return sum(fleet.models[m] for m in added)

        # add: the affected nodes are known only once placed -- all 200 new replicas run somewhere.
        await self.phase(
            "add", lambda: write(self.catalogs, "added.yaml", catalog([model_yaml(m, 2) for m in sorted(added)])),
            lambda agent, specs: any(s.model in added for s in specs),
            lambda times: new_running() == 200,
            lambda r: sum(r.models[m] for m in added) == 200,
            on_ready=lambda rep: rep.spec.model in added)
        holding = {a.name for a in fleet.agents if any(r.spec.model in added for r in a.replicas.values())}
        await self.phase(
            "remove", lambda: write(self.catalogs, "added.yaml", None),
            lambda agent, specs: agent.name in holding and not any(s.model in added for s in specs),
            lambda times: times.keys() >= holding,
            lambda r: not any(r.models[m] for m in added))
        old = {rid for rid, (_, r) in fleet.running().items() if r.spec.model == "big"}
        changed = [model_yaml("big", self.big, ("--changed",))] + base[1:]

        def replaced() -> bool:
            return fleet.models["big"] - sum(rid in fleet.where for rid in old) == self.big

        # profile: the replacements' specs reach the nodes they are placed on (the old
        # replicas stop once those are ready: the routers' condition below).
        await self.phase(
            "profile", lambda: write(self.catalogs, "base.yaml", catalog(changed)),
            lambda agent, specs: any(s.model == "big" and s.id not in old for s in specs),
            lambda times: replaced(),
            lambda r: r.models["big"] == self.big and not any(rid in r.endpoints for rid in old),
            on_ready=lambda rep: rep.spec.model == "big")

    async def restart(self, session: aiohttp.ClientSession) -> None:
        fleet = self.fleet
        running = len(fleet.running())
        starts0, stops0 = fleet.starts(), fleet.stops()
        # The versions the routers hold from the controller about to die: taken
        # before the kill, not once the new one settled -- by then a router may
        # already hold the new controller's first version, and with nothing
        # changing after the settle it would never be given another.
        versions = {r.version for r in fleet.routers}
        self.serve.send_signal(signal.SIGKILL)
        self.serve.wait()
        t0 = time.monotonic()
        self.start_serve()
        await self.until("serve up again", lambda: self.healthy(session), 60)
        up = time.monotonic() - t0
        # Reports that failed while serve was down are expected; the ones after it is up are what it refused or was late for.
        failed_up = collections.Counter(fleet.report_failures)

        async def settled() -> bool:
            try:
                return (await self.get(session, "/readyz"))[0] == 200
            except (aiohttp.ClientError, OSError):
                return False
        await self.until("settled", settled, self.args.timeout)
        took = time.monotonic() - t0
        await self.until("every router on the new controller, whole",
                         lambda: all(r.version not in versions for r in fleet.routers) and self.routers_have(running),
                         self.args.timeout)
        whole = time.monotonic() - t0
        await asyncio.sleep(self.args.heartbeat)     # anything it would start or stop, it has by now
        print(f"restart      {running} replicas: up {up:.1f} s, settled {took:.1f} s, every router whole "
              f"{whole:.1f} s after the kill; caused {fleet.starts() - starts0} starts, "
              f"{fleet.stops() - stops0} stops; reports failed once up: "
              f"{dict(fleet.report_failures - failed_up) or 'none'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=500)
    p.add_argument("--routers", type=int, default=50)
    p.add_argument("--heartbeat", type=float, default=10.0)
    p.add_argument("--steady", type=float, default=30.0, help="seconds of the steady-state window")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds any one phase may take")
    p.add_argument("--restart", action="store_true", help="also kill and restart the controller")
    p.add_argument("--no-changes", action="store_true",
                   help="skip the add/remove/profile phases (for a run that wants converge, steady, status)")
    p.add_argument("--calls", type=int, default=50,
                   help="GETs of each of /healthz, status, /metrics, one after another (a p99 needs more than 20)")
    p.add_argument("--routers-in-process", action="store_true",
                   help="run the routers on the simulator's loop, as the bench did before (their clocks then "
                        "include the agents' lag)")
    p.add_argument("--serve-arg", action="append", help="an extra argument for serve (repeatable)")
    a = p.parse_args()
    import resource as r
    soft, hard = r.getrlimit(r.RLIMIT_NOFILE)
    r.setrlimit(r.RLIMIT_NOFILE, (hard, hard))
    from llmgwctl.aio import run
    run(Bench(a).main())


if __name__ == "__main__":
    main()
