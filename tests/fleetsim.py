"""A simulated fleet: thousands of node agents and N standalone routers, on one loop or two processes.

Test tooling for the control plane at fleet scale: `python3 -m bench.fleet`
measures a real `llmgwctl serve --no-local-agent` with it, and
`tests/e2e/test_fleetsim.py` runs a small one as a test. Everything crosses
the real HTTP protocol, built from the project's own contract types:

- `SimAgent` is one node: a stable instance id and boot id, GPUs, the `sim`
  engine. It POSTs its `AgentReport` on every change and as a heartbeat on
  its own random phase, and long-polls its desired list. A desired replica
  "starts" (STARTING at once) and reports READY after a random delay, with a
  stand-in URL on the node's advertised host -- each node advertises its own
  127.x.y.z, so URLs are distinct and pass the controller's host check --
  where nothing listens (the catalog's `sim` engine has no metrics path, so no
  router polls it). A replica no longer desired is gone at once.
- `SimRouter` follows `/api/v1/watch/endpoints` as a standalone router does
  (asking for deltas, `delta=True`, as `llmgwctl router` does) and keeps only
  what the measurements need (`RouterView`): the version and which replica
  ids it was told, with when. With `router_process=True` the routers run in
  a child process of their own (`RouterProcess`), as a real fleet's routers
  are other machines: their clocks then leave out the agents' loop, and the
  parent keeps a view of each from one line per answer.

Serve on loopback without a token: agents then need no node tokens. The
agents share one aiohttp session (one process cannot afford thousands of
pools); each still holds its own long-poll connection.

What the measurements read: `SimAgent.starts` / `stops` (a restarted
controller must adopt, i.e. cause none), `on_desired` / `on_endpoints`
(called with the arrival time of every answer).
"""
from __future__ import annotations

import asyncio
import collections
import fcntl
import json
import random
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from llmgwctl.aio import Flag, sleep_unless
from llmgwctl.backoff import Backoff
from llmgwctl.contracts import AgentReport, EngineAvailability, Gpu, ReplicaSpec, ReplicaState, ReportedReplica

# The catalog engine every simulated replica runs: nothing on disk runs it, and
# without a metrics path no router polls the stand-in URLs.
ENGINE_YAML = "engines:\n  sim:\n    command: [\"sim-engine\", \"{port}\"]\n"
# Long-polls are held ~30 s by the controller; 45 s means the connection is dead (the agent's own number).
POLL_TIMEOUT = 45.0


def node_host(i: int) -> str:
    """Node i's advertised host: its own loopback address, so every replica URL is distinct."""
    return f"127.{1 + i // 62500}.{(i // 250) % 250}.{1 + i % 250}"


@dataclass
class SimReplica:
    spec: ReplicaSpec
    port: int
    state: ReplicaState = ReplicaState.STARTING


class SimAgent:
    def __init__(self, fleet: SimFleet, index: int, *, gpus: int = 8, pools: tuple[str, ...] = ()):
        self.fleet = fleet
        self.name = f"sim-{index:05d}"
        self.host = node_host(index)
        self.instance_id = uuid.uuid4().hex         # stable for the agent's life, across controller restarts
        self.boot_id = uuid.uuid4().hex
        self.gpus = tuple(Gpu(index=g, uuid=f"{self.name}-gpu{g}", name="SIM-80GB", memory_mib=81920)
                          for g in range(gpus))
        self.pools = pools
        self.replicas: dict[str, SimReplica] = {}
        self.version = 0
        self.starts = 0
        self.stops = 0
        self.reports = 0
        # A Flag: the report goes out one step of this loop after the change, not three (each
        # step as long as a thousand agents' answers in a rollout: the bench's lag, not serve's).
        self._changed = Flag()
        self._body: bytes | None = None
        self._specs: dict[str, ReplicaSpec] = {}    # the last desired list's specs, by id
        self._next_port = 20000

    def report(self) -> AgentReport:
        reps = []
        for rid in sorted(self.replicas):
            r = self.replicas[rid]
            ready = r.state == ReplicaState.READY
            reps.append(ReportedReplica(
                id=rid, spec_hash=r.spec.spec_hash, model=r.spec.model, profile=r.spec.profile, engine=r.spec.engine,
                gpu_indices=r.spec.gpu_indices, state=r.state, port=r.port, pid=10000 + r.port,
                url=f"http://{self.host}:{r.port}" if ready else None, spec=r.spec))
        return AgentReport(node=self.name, instance_id=self.instance_id, boot_id=self.boot_id, agent_version="sim",
                           advertise_host=self.host, pools=self.pools, gpus=self.gpus,
                           engines={"sim": EngineAvailability(True)}, replicas=tuple(reps))

    def _change(self) -> None:
        self._body = None
        self._changed.set()

    def apply(self, specs: Iterable[ReplicaSpec]) -> None:
        wanted = {s.id: s for s in specs}
        gone = [r for r in self.replicas if r not in wanted]
        new = [s for rid, s in wanted.items() if rid not in self.replicas]
        f = self.fleet
        for rid in gone:
            f.models[self.replicas.pop(rid).spec.model] -= 1
            f.where.pop(rid, None)
            self.stops += 1
        loop = asyncio.get_running_loop()
        for spec in new:
            self._next_port += 1
            self.replicas[spec.id] = rep = SimReplica(spec, self._next_port)
            f.models[spec.model] += 1
            f.where[spec.id] = self
            self.starts += 1
            loop.call_later(random.uniform(*self.fleet.ready_after), self._ready, rep)
        # Like the real agent: a report on a change only. A list that changes
        # nothing (a restarted controller's first answer) sends none -- the
        # controller's settling window counts on that.
        if gone or new:
            self._change()

    def _ready(self, rep: SimReplica) -> None:
        if self.replicas.get(rep.spec.id) is rep:
            rep.state = ReplicaState.READY
            self.fleet.on_ready(self, rep, time.monotonic())
            self._change()

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(self._report_loop(stop), self._desired_loop(stop))

    async def _report_loop(self, stop: asyncio.Event) -> None:
        f = self.fleet
        retry = Backoff(initial=1.0, cap=f.heartbeat)
        # A random phase: a fleet started together must not heartbeat in step.
        await sleep_unless(random.uniform(0, f.heartbeat), stop)
        while not stop.is_set():
            self._changed.clear()
            if self._body is None:
                self._body = json.dumps(self.report().to_dict()).encode()
            try:
                async with f.session.post(f"{f.url}/api/v1/agents/{self.name}/report", data=self._body,
                                          headers={"Content-Type": "application/json"},
                                          timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    await resp.read()
                    ok = resp.status < 300
                    if not ok:
                        f.report_failed(f"HTTP {resp.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                ok = False
                f.report_failed(type(exc).__name__)
            if not ok:
                await sleep_unless(retry.failure(), stop)
                continue
            retry.reset()
            self.reports += 1
            await sleep_unless(f.heartbeat, stop, self._changed)

    async def _desired_loop(self, stop: asyncio.Event) -> None:
        f = self.fleet
        retry = Backoff(initial=1.0, cap=10.0)
        url = f"{f.url}/api/v1/agents/{self.name}/desired"
        while not stop.is_set():
            try:
                async with f.session.get(url, params={"after": str(self.version), "instance": self.instance_id},
                                         timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT)) as resp:
                    if resp.status == 204:
                        await resp.read()
                        retry.reset()
                        continue
                    if resp.status != 200:
                        raise aiohttp.ClientError(f"HTTP {resp.status}")
                    doc = json.loads(await resp.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                f.poll_errors += 1
                await sleep_unless(retry.failure(), stop)
                continue
            retry.reset()
            if doc["version"] == self.version:
                continue
            self.version = doc["version"]
            # A replica's spec never changes under its id: only new ones are parsed (at 5,000
            # nodes a rollout is a thousand answers at once, on the loop the routers' share).
            specs = [self._specs[s["id"]] if s.get("id") in self._specs else ReplicaSpec.from_dict(s)
                     for s in doc["replicas"]]
            self._specs = {spec.id: spec for spec in specs}
            f.on_desired(self, time.monotonic(), specs)
            self.apply(specs)


_VERSION = re.compile(rb'^\{"version": (-?\d+)')
_ENDPOINT = re.compile(rb'\{"replica_id": "([^"]*)", "model": "([^"]*)"')


def _version(raw: bytes) -> re.Match[bytes]:
    """The watch answer's leading `{"version": N`; ValueError if it does not lead with one."""
    head = _VERSION.search(raw)
    if head is None:
        raise ValueError(f"a watch answer without its version first: {raw[:80]!r}")
    return head


def controller_answer_matches(raw: bytes) -> bool:
    """Whether the patterns read a watch answer as json.loads does (for a test of this module)."""
    doc = json.loads(raw)
    return (int(_version(raw).group(1)) == doc["version"]
            and {r.decode(): m.decode() for r, m in _ENDPOINT.findall(raw)}
            == {e["replica_id"]: e["model"] for e in doc["endpoints"]})


class RouterView:
    """What a router holds from the watch stream: the version and which replica ids it was told.

    Kept by a `SimRouter` on the simulator's loop, or, for routers in their own
    process (`RouterProcess`), by the parent's mirror of each, from the changes
    the child computed.
    """

    def __init__(self, index: int, *, delta: bool = True):
        self.index = index
        self.delta = delta                          # False: a router older than delta answers
        self.version = 0
        self.endpoints: dict[str, str] = {}         # replica id -> model
        self.answers = 0                            # answers that changed the version
        self.bytes = 0                              # their bytes
        # Endpoints per model, kept with `endpoints`: what a measurement asks on every answer,
        # without walking 20,000 entries on the loop the agents run on.
        self.models: collections.Counter[str] = collections.Counter()
        self.deltas = 0                             # answers that were deltas

    def apply(self, version: int, added: dict[str, str], removed: Iterable[str], delta: bool, size: int) -> None:
        for rid in removed:
            model = self.endpoints.pop(rid, None)
            if model is not None:
                self.models[model] -= 1
        for rid, model in added.items():
            was = self.endpoints.get(rid)
            if was is not None:
                self.models[was] -= 1
            self.endpoints[rid] = model
            self.models[model] += 1
        self.version = version
        self.answers += 1
        self.bytes += size
        self.deltas += delta


class _Host(Protocol):
    """What a SimRouter runs against: the fleet in process, or the router process's own host."""

    url: str
    session: aiohttp.ClientSession
    watch_errors: int

    def answered(self, router: SimRouter, arrived: float) -> None: ...


class SimRouter(RouterView):
    """A standalone router as far as the watch stream goes: what it was told, and when."""

    def __init__(self, host: _Host, index: int, *, delta: bool = True):
        super().__init__(index, delta=delta)
        self.host = host
        # The last answer's change as apply() took it, for a host that passes it on (the router process).
        self.last: tuple[int, bool, int, dict[str, str], list[str]] = (0, False, 0, {}, [])

    async def run(self, stop: asyncio.Event) -> None:
        f = self.host
        retry = Backoff(initial=0.5, cap=5.0)
        while not stop.is_set():
            try:
                params = {"after": str(self.version), **({"delta": "1"} if self.delta else {})}
                async with f.session.get(f"{f.url}/api/v1/watch/endpoints", params=params,
                                         timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT)) as resp:
                    if resp.status != 200:
                        raise aiohttp.ClientError(f"HTTP {resp.status}")
                    raw = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                f.watch_errors += 1
                await sleep_unless(retry.failure(), stop)
                continue
            retry.reset()
            arrived = time.monotonic()
            head = _version(raw)
            version = int(head.group(1))

            if version == self.version:
                continue
            is_delta = raw.startswith(b', "delta": ', head.end())
            if is_delta:
                delta = json.loads(raw)["delta"]         # a few endpoints: small
                if delta["since"] != self.version:
                    self.version = 0                    # as the real router: ask for the whole list
                    f.watch_errors += 1
                    continue
                added = {e["replica_id"]: e["model"] for e in delta["endpoints"]}
                removed = list(delta["removed"])
            else:
                # Read with a pattern, not json.loads: at 20,000 endpoints an answer is
                # ~4 MB, and fifty routers parsing each one whole starved the agents on
                # the same loop of their heartbeats. The controller writes the keys in
                # Endpoint.to_dict's order; `controller_answer_matches` checks that.
                whole = {rid.decode(): model.decode() for rid, model in _ENDPOINT.findall(raw)}
                # As a change, so that a router process sends a fallback's whole answer
                # (20,000 ids) as the few that differ.
                added = {rid: m for rid, m in whole.items() if self.endpoints.get(rid) != m}
                removed = [rid for rid in self.endpoints if rid not in whole]
            self.apply(version, added, removed, is_delta, len(raw))
            self.last = (version, is_delta, len(raw), added, removed)
            f.answered(self, arrived)


class RouterProcess:
    """N SimRouters in a child process of their own, and the parent's mirror of each (`views`).

    In a real fleet the routers are other machines; on the simulator's loop
    every router's clock also carried the lag of 5,000 agents (up to a
    thousand long-poll answers at once in a rollout). The child runs the
    routers on its own loop and session (`python -m tests.fleetsim URL N`)
    and writes one JSON line per answer that changed a router: index, arrival
    time (time.monotonic is CLOCK_MONOTONIC, one clock for every process on
    Linux), version, whether it was a delta, its size, the ids added with
    their model and the ids removed. The parent applies the line to the
    router's view and calls `on_endpoints` with the child's arrival time.
    """

    # A line holds one answer's change: up to 20,000 ids when a router first meets a
    # whole fleet, ~1 MB; asyncio's default 64 KiB limit would end the reader.
    LINE_LIMIT = 64 << 20

    def __init__(self, url: str, routers: int):
        self.url = url
        self.views = [RouterView(i) for i in range(routers)]
        self.watch_errors = 0
        self.pid: int | None = None
        # This loop's share: lines applied, seconds spent on them (parse, apply, on_endpoints), the longest one.
        self.lines = 0
        self.busy = self.longest = 0.0
        self.on_endpoints: Callable[[RouterView, float], None] = lambda r, t: None

    async def run(self, stop: asyncio.Event) -> None:
        whole = ",".join(str(v.index) for v in self.views if not v.delta)
        root = Path(__file__).resolve().parent.parent
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.fleetsim", self.url, str(len(self.views)), whole,
            stdout=asyncio.subprocess.PIPE, cwd=root, limit=self.LINE_LIMIT)
        self.pid = proc.pid
        assert proc.stdout is not None
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while True:
                reading = asyncio.ensure_future(proc.stdout.readline())
                await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    reading.cancel()
                    break
                line = reading.result()
                if not line:
                    break
                began = time.perf_counter()
                doc = json.loads(line)
                if isinstance(doc, dict):
                    self.watch_errors = doc["watch_errors"]
                    continue
                index, arrived, version, delta, size, errors, added, removed = doc
                self.watch_errors = errors
                view = self.views[index]
                view.apply(version, added, removed, delta, size)
                self.on_endpoints(view, arrived)
                took = time.perf_counter() - began
                self.lines += 1
                self.busy += took
                self.longest = max(self.longest, took)
        finally:
            stopping.cancel()
            if proc.returncode is None:
                proc.terminate()
            try:
                # Read to the end: the child's last line has its final count of failed
                # watches, and a child blocked on a full pipe could not exit at all.
                rest = await asyncio.wait_for(proc.stdout.read(), 10)
                for line in rest.splitlines()[-1:]:
                    doc = json.loads(line)
                    if isinstance(doc, dict):
                        self.watch_errors = doc["watch_errors"]
                await asyncio.wait_for(proc.wait(), 10)
            except (asyncio.TimeoutError, ValueError):
                proc.kill()
                await proc.wait()


class _ChildHost:
    """The router process's side: its routers, its session, and the lines it writes."""

    def __init__(self, url: str, routers: int, whole: set[int]):
        self.url = url.rstrip("/")
        self.session: aiohttp.ClientSession = None  # type: ignore[assignment]  # made on the loop, in run()
        self.watch_errors = 0
        self.routers = [SimRouter(self, i, delta=i not in whole) for i in range(routers)]
        self.out = sys.stdout.buffer

    def answered(self, router: SimRouter, arrived: float) -> None:
        # Written at once and blocking: a line is read by the parent as it comes, and a
        # full pipe holding the loop up is the parent being slow, which it must not be.
        version, delta, size, added, removed = router.last
        self.out.write(json.dumps([router.index, arrived, version, delta, size, self.watch_errors,
                                   added, removed]).encode() + b"\n")
        self.out.flush()

    async def run(self) -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)) as self.session:
            tasks = [asyncio.ensure_future(r.run(stop)) for r in self.routers]
            # A router waits in its long-poll up to 30 s: stop ends them at once.
            await stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.out.write(json.dumps({"watch_errors": self.watch_errors}).encode() + b"\n")
        self.out.flush()


class SimFleet:
    """`nodes` agents and `routers` routers against the control API at `url`; `run(stop)` until stopped."""

    def __init__(self, url: str, nodes: int, *, routers: int = 0, heartbeat: float = 10.0, gpus: int = 8,
                 ready_after: tuple[float, float] = (0.2, 1.0), router_process: bool = False):
        self.url = url.rstrip("/")
        self.heartbeat = heartbeat
        self.ready_after = ready_after
        self.session: aiohttp.ClientSession = None  # type: ignore[assignment]  # made on the loop, in run()
        self.agents = [SimAgent(self, i, gpus=gpus) for i in range(nodes)]
        # router_process: the routers run in a child process (`RouterProcess`) and
        # `routers` are the parent's views of them; else they run on this loop.
        self.router_process = RouterProcess(self.url, routers) if router_process else None
        self.routers: list[RouterView] = (
            list(self.router_process.views) if self.router_process else [SimRouter(self, i) for i in range(routers)])
        if self.router_process:
            self.router_process.on_endpoints = lambda r, t: self.on_endpoints(r, t)
        self.report_errors = self.poll_errors = self.watch_errors = 0   # watch_errors: routers on this loop
        # Failed reports by what failed them (an HTTP status, or the exception's type: a
        # refused connect while serve is down, a timeout while it is busy).
        self.report_failures: collections.Counter[str] = collections.Counter()
        # Kept by the agents as they start and stop replicas: running replicas per model
        # (any state), and which agent runs each id (cheap questions for a measurement).
        self.models: collections.Counter[str] = collections.Counter()
        self.where: dict[str, SimAgent] = {}
        # Observers the measurements set: (agent, arrival time, specs), (router, arrival time), (agent, replica, t).
        self.on_desired: Callable[[SimAgent, float, list[ReplicaSpec]], None] = lambda a, t, s: None
        self.on_endpoints: Callable[[RouterView, float], None] = lambda r, t: None
        self.on_ready: Callable[[SimAgent, SimReplica, float], None] = lambda a, r, t: None

    async def run(self, stop: asyncio.Event) -> None:
        # No pool limit: every agent holds a long-poll, and reports share what is left idle.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as self.session:
            routers = ([self.router_process.run(stop)] if self.router_process
                       else [r.run(stop) for r in self.routers if isinstance(r, SimRouter)])
            await asyncio.gather(*(a.run(stop) for a in self.agents), *routers)

    def report_failed(self, why: str) -> None:
        self.report_errors += 1
        self.report_failures[why] += 1

    def watch_failures(self) -> int:
        """Failed watch answers (and delta fallbacks) of every router, on this loop or in their process."""
        return self.watch_errors + (self.router_process.watch_errors if self.router_process else 0)

    def answered(self, router: SimRouter, arrived: float) -> None:
        self.on_endpoints(router, arrived)

    # -- what measurements and tests read ------------------------------------------------

    def running(self) -> dict[str, tuple[str, SimReplica]]:
        """Every replica the fleet runs: id -> (node, replica)."""
        return {rid: (a.name, r) for a in self.agents for rid, r in a.replicas.items()}

    def starts(self) -> int:
        return sum(a.starts for a in self.agents)

    def stops(self) -> int:
        return sum(a.stops for a in self.agents)



def _router_process_main() -> None:
    """`python -m tests.fleetsim URL ROUTERS [WHOLE]`: the child `RouterProcess` starts.

    WHOLE: comma-separated indices of routers that ask without delta (old routers).
    Lines to stdout until SIGTERM, then one line with the failed watches.
    """
    url, routers = sys.argv[1], int(sys.argv[2])
    whole = {int(i) for i in sys.argv[3].split(",") if i} if len(sys.argv) > 3 else set()
    try:
        # A bigger pipe (1 MiB, Linux's default cap) so a burst of lines -- fifty routers
        # told the same change -- does not block this loop on the parent's next read.
        fcntl.fcntl(sys.stdout.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except OSError:
        pass
    from llmgwctl.aio import run
    run(_ChildHost(url, routers, whole).run())


if __name__ == "__main__":
    _router_process_main()
