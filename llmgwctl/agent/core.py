"""The agent's core: converge the engines on this node to the desired replicas.

Owns the replicas this node runs and their life (starting, ready, failed,
stopping), one process group each. Level-triggered: `reconcile_once()` looks
at what runs and what is desired and does what differs -- start what is
desired and missing, stop what runs and is no longer desired, replace what
runs with another spec hash, restart what crashed once its backoff is over.
The loop only calls it on a tick or when woken, so a test drives it directly.

It must not know where the desired list comes from (a controller's long-poll
or a file) nor where reports go: the runner hands it specs with
`set_desired()` and reads `report()` when `on_change` fires. Engines are found
through the `driver_for` function it is given, so it knows no engine by name.

Safety rules that shape it:
- Until a desired list has arrived, nothing is stopped: a freshly restarted
  agent adopts what it finds and waits to be told.
- A controller that goes away changes nothing here: the last desired holds.
- Nothing is signalled unless it is provably ours (procs.group_is_ours).
- What runs is the node's choice: `driver_for` refuses a catalog engine its
  operator did not allow (EngineNotAllowed), and a replica whose env or args
  would load other code into its engine (SpecNotAllowed: LD_PRELOAD,
  --trust-remote-code...) unless the operator allowed that option. Either
  refusal (a NotAllowed) stands whatever the desired list says -- the replica
  is failed with the reason, and an adopted engine the node no longer allows
  is stopped even before a desired list arrives.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

import aiohttp

from .. import __version__
from ..contracts import AgentReport, CpuCapacity, EngineAvailability, Gpu, ReplicaSpec, ReplicaState, ReportedReplica
from ..engines.errors import EngineError, LaunchError, NotAllowed
from ..engines.spec import Driver
from . import procs, state
from .state import Record
from ..aio import cancel_and_wait, sleep_unless
from ..backoff import Backoff
from .backoff import restart_schedule
from .ports import PortRange, pick_port

log = logging.getLogger("llmgw.agent")

# The four states a replica has on its node (contracts.AGENT_STATES).
STARTING, READY, FAILED, STOPPING = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED,
                                     ReplicaState.STOPPING)

# 10 min to pass health after launch: vLLM loading a 70B model from local disk
# and capturing CUDA graphs takes several minutes; longer than this is a hang
# (a stuck download, a deadlocked NCCL init) that a restart may clear.
START_TIMEOUT = 600.0
# 15 s between SIGTERM and SIGKILL: vLLM and SGLang need a few seconds to stop
# their worker processes and release GPU memory, and a replica is already out
# of the router (drained) before the controller asks for the stop; an engine
# still up after that is wedged, and holding its GPUs longer helps nobody.
STOP_GRACE = 15.0
# 1 s pass: crash detection and health polling latency, against a handful of
# /proc reads and local HTTP probes per replica per pass.
TICK = 1.0
# 2 s per health probe: a local engine that is up answers in milliseconds; a
# slow answer during loading counts as not ready yet, and it is re-probed next pass.
PROBE_TIMEOUT = 2.0
# A starting engine is probed between passes too: the moment its health passes
# is the moment it can serve, and a notice one pass late is up to a second of
# a cold start that its model's queue pays for (traced from placement to the
# router, the wait for the agent's next pass was the largest share of what
# was not the engine's own start-up). The wait between probes
# grows with the time it has been starting -- 5 % of it, from 50 ms up to one
# pass -- so readiness is noticed within about 5 % of the start-up's length:
# ~0.2 s after a 4 s start, at most a pass after vLLM's minutes. That is ~50
# loopback probes over the first 4 s, then one a pass: nothing next to an
# engine loading weights.
PROBE_SHARE, PROBE_MIN = 0.05, 0.05
# After SIGKILL the kernel tears a group down in well under a second; 5 s
# bounds the wait so a process stuck in uninterruptible I/O (D state) cannot
# wedge a stop. It is logged and the group is reported as still there.
KILL_WAIT = 5.0

DriverLookup = Callable[[ReplicaSpec], Driver]


@dataclass(eq=False)
class Replica:
    """One desired replica on this node and, while it has one, its process."""

    spec: ReplicaSpec
    backoff: Backoff
    state: ReplicaState = STARTING
    gpu_indices: tuple[int, ...] = ()
    port: int | None = None
    pid: int | None = None
    start_time: int | None = None
    pgid: int | None = None
    popen: subprocess.Popen | None = None   # None when adopted: not our child, polled by pid
    health_path: str = "/health"
    started_at: float = 0.0
    restarts: int = 0
    last_exit: int | None = None
    last_log: list[str] = field(default_factory=list)
    reason: str = ""
    next_start: float | None = None         # when a failed replica may start again; None = not by itself
    next_probe: float = 0.0                 # starting: when its health is probed next between passes
    group_task: asyncio.Task | None = None  # stopping, or clearing a crashed engine's leftovers

    @property
    def running(self) -> bool:
        return self.pid is not None

    def record(self) -> Record | None:     # not state.Record: in this class `state` is the field
        if self.pid is None or self.start_time is None or self.pgid is None or self.port is None:
            return None
        spec = dataclasses.replace(self.spec, gpu_indices=self.gpu_indices)
        return state.Record(spec=spec, pid=self.pid, start_time=self.start_time, pgid=self.pgid,
                            port=self.port, restarts=self.restarts, health_path=self.health_path)


class Agent:
    def __init__(self, *, node: str, gpus: Iterable[Gpu], state_dir: Path, ports: PortRange,
                 driver_for: DriverLookup, session: aiohttp.ClientSession, host: str = "127.0.0.1",
                 pools: Iterable[str] = (), engines: Mapping[str, tuple[bool, str]] | None = None,
                 start_timeout: float = START_TIMEOUT, grace: float = STOP_GRACE,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, cpu: CpuCapacity | None = None):
        self.node = node
        self.cpu = cpu      # what the report says of the CPU side (agent.capacity); None: nothing
        self.gpus = tuple(gpus)
        self.state_dir = Path(state_dir)
        self.ports = ports
        self.host = host
        self.pools = tuple(pools)
        self.engines = {name: EngineAvailability(*pair) for name, pair in (engines or {}).items()}
        self.driver_for = driver_for
        self.session = session
        self.start_timeout = start_timeout
        self.grace = grace
        self.on_change = on_change
        self.clock = clock
        # Which agent process this is: new on every start, so the controller can
        # tell a second agent claiming this node from this one's next heartbeat.
        self.instance_id = uuid.uuid4().hex
        # The instance that last used this state directory (read in adopt()):
        # sent so the controller lets this agent take over at once after a restart.
        self.previous_instance_id = ""
        self.machine_boot = procs.boot_id()
        self.replicas: dict[str, Replica] = {}
        self.desired: tuple[ReplicaSpec, ...] | None = None
        self._wake = asyncio.Event()
        self._availability: dict[tuple, EngineAvailability] = {}
        self._saved: list[dict] | None = None

    # -- inputs -------------------------------------------------------------

    def set_desired(self, specs: Iterable[ReplicaSpec]) -> None:
        self.desired = tuple(specs)
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def log_path(self, replica_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in replica_id)
        return self.log_dir / f"{safe}.log"

    def url(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    # -- adoption -----------------------------------------------------------

    async def adopt(self) -> list[str]:
        """Take over the engines a previous run of this agent left running.

        An engine is adopted only if its pid is alive with the recorded start
        time; it then starts in `starting` and becomes ready when its health
        check passes, with its restart count kept. A record that matches no
        live process is dropped; the only thing signalled then is what its
        dead engine left in its own group (see _clear_leftovers), never a
        process that merely reuses its pid. Returns adopted ids.
        """
        self.previous_instance_id = await asyncio.to_thread(state.previous_instance, self.state_dir)
        records = await asyncio.to_thread(state.load, self.state_dir, self.machine_boot)
        adopted = []
        now = self.clock()
        for rec in records:
            alive = await asyncio.to_thread(procs.is_same_process, rec.pid, rec.start_time)
            if not alive:
                log.info("replica %s: pid %d from the last run is gone; not adopting it", rec.spec.id, rec.pid)
                await self._clear_leftovers(rec)
                continue
            self.replicas[rec.spec.id] = Replica(
                spec=rec.spec, backoff=restart_schedule(self.clock), state=STARTING,
                gpu_indices=rec.spec.gpu_indices, port=rec.port, pid=rec.pid, start_time=rec.start_time,
                pgid=rec.pgid, health_path=rec.health_path, started_at=now, restarts=rec.restarts)
            adopted.append(rec.spec.id)
            log.info("replica %s: adopted pid %d on port %d", rec.spec.id, rec.pid, rec.port)
            refusal = self._refusal(rec.spec)
            if refusal:
                # Started before this node's allowance changed: what the operator
                # no longer allows stops now, not when a controller says so.
                self._stop(self.replicas[rec.spec.id], refusal)
        if adopted:
            self._changed()
        # Claim the state directory for this instance at once, so a crash before
        # the first pass still lets the next agent prove it succeeds this one.
        await self._save_state()
        return adopted

    async def _clear_leftovers(self, rec: state.Record) -> None:
        """Kill what an engine that died while no agent watched left in its group.

        Its worker processes may still hold GPU memory. They are ours beyond
        doubt only if the leader's pid is not in use at all (see
        procs.group_is_ours); a reused pid means the group is long gone.
        """
        leader_free = await asyncio.to_thread(procs.start_time, rec.pgid) is None
        # len(): with a bare list after `and`, mypy infers group_members as if it returned bool.
        if leader_free and len(await asyncio.to_thread(procs.group_members, rec.pgid)) > 0:
            log.warning("replica %s: its engine died while the agent was down; stopping what it left "
                        "in process group %d", rec.spec.id, rec.pgid)
            await self._signal_and_wait(rec.spec.id, rec.pgid, None)

    # -- the pass -----------------------------------------------------------

    async def reconcile_once(self) -> None:
        """One level-triggered pass: observe processes, probe, then converge on desired."""
        await self._observe_exits()
        await self._probe_starting()
        if self.desired is not None:
            await self._converge(self.desired)
        await self._housekeeping()

    async def run(self, stop: asyncio.Event, tick: float = TICK) -> None:
        """Reconcile every `tick` seconds or when woken, until `stop` is set; probe starting engines between.

        Between passes only the starting engines whose next probe is due are
        probed (PROBE_SHARE): one that turns healthy is ready, and reported,
        at once instead of at the next pass.
        """
        next_pass = self.clock()
        while not stop.is_set():
            try:
                if self._wake.is_set() or self.clock() >= next_pass:
                    self._wake.clear()
                    await self.reconcile_once()
                    next_pass = self.clock() + tick
                else:
                    await self._probe_starting(due_only=True)
            except Exception:  # a bug in one pass must not end the agent: engines would go unwatched
                log.exception("reconcile pass failed; retrying next tick")
                next_pass = self.clock() + tick
            await sleep_unless(max(0.0, min(next_pass, self._next_probe()) - self.clock()), self._wake, stop)

    def _next_probe(self) -> float:
        """When the soonest starting engine is due a probe between passes; infinity when none is starting."""
        return min((r.next_probe for r in self.replicas.values() if r.state == STARTING and r.pid is not None),
                   default=float("inf"))

    async def close(self) -> None:
        """Leave the engines running (the next agent adopts them) and write the state file.

        Stops in progress are cancelled; their records stay in the state file
        as long as their processes live, so the next run finishes them.
        """
        await cancel_and_wait(*(r.group_task for r in self.replicas.values() if r.group_task))
        await self._save_state()

    async def _observe_exits(self) -> None:
        for r in list(self.replicas.values()):
            if r.state not in (STARTING, READY) or r.pid is None:
                continue
            if r.popen is not None:
                code = r.popen.poll()
                if code is None:
                    continue
            else:
                if await asyncio.to_thread(procs.is_same_process, r.pid, r.start_time or -1):
                    continue
                code = None   # not our child: the exit code went to its new parent
            await self._crashed(r, code, f"engine exited with {_describe_exit(code)}")

    async def _crashed(self, r: Replica, code: int | None, reason: str) -> None:
        r.last_exit = code
        r.last_log = await asyncio.to_thread(procs.tail, self.log_path(r.spec.id))
        delay = r.backoff.failure()
        r.next_start = self.clock() + delay
        r.state, r.reason = FAILED, reason
        log.warning("replica %s: %s; restarting in %.0fs", r.spec.id, reason, delay)
        # Whatever the engine left in its group (worker processes holding GPU
        # memory) goes before the restart, which waits for this task.
        r.group_task = asyncio.create_task(self._terminate(r, detach=True))
        self._changed()

    async def _probe_starting(self, due_only: bool = False) -> None:
        """Probe the starting engines' health (a pass probes all of them; between passes, those due)."""
        now = self.clock()
        starting = [r for r in self.replicas.values() if r.state == STARTING and r.pid is not None
                    and (not due_only or r.next_probe <= now)]
        if not starting:
            return
        results = await asyncio.gather(*(self._probe(r) for r in starting))
        now = self.clock()
        for r, ok in zip(starting, results):
            if r.state != STARTING:
                continue
            r.next_probe = now + min(TICK, max(PROBE_MIN, PROBE_SHARE * (now - r.started_at)))
            if ok:
                assert r.port is not None   # it was probed: see _probe
                r.state, r.reason = READY, ""
                r.backoff.ready()
                log.info("replica %s: ready at %s (pid %d)", r.spec.id, self.url(r.port), r.pid)
                self._changed()
            elif now - r.started_at > self.start_timeout:
                await self._crashed(r, None, f"not healthy within {self.start_timeout:.0f}s of starting")

    async def _probe(self, r: Replica) -> bool:
        port = r.port
        # Only a replica with a pid is probed, and _start and adoption set its port with its pid.
        assert port is not None
        # An engine bound to every address is probed on loopback: the probe must
        # not depend on how this node's advertised address routes.
        if self.host in ("0.0.0.0", "::"):
            url = f"http://127.0.0.1:{port}{r.health_path}"
        else:
            url = self.url(port) + r.health_path
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _converge(self, desired: tuple[ReplicaSpec, ...]) -> None:
        want = {s.id: s for s in desired}
        r: Replica | None   # the second loop's lookup may find none
        for r in list(self.replicas.values()):
            if r.state == STOPPING:
                continue
            spec = want.get(r.spec.id)
            if spec is None:
                self._stop(r, "no longer desired")
            elif spec.spec_hash != r.spec.spec_hash:
                self._stop(r, f"spec changed ({r.spec.spec_hash} -> {spec.spec_hash}); replacing it")
        now = self.clock()
        for spec in desired:
            r = self.replicas.get(spec.id)
            if r is None:
                r = self.replicas[spec.id] = Replica(spec=spec, backoff=restart_schedule(self.clock))
                await self._start(r)
            elif (r.state == FAILED and r.next_start is not None and now >= r.next_start
                  and (r.group_task is None or r.group_task.done())):
                r.restarts += 1
                await self._start(r)

    # -- start and stop -----------------------------------------------------

    async def _start(self, r: Replica) -> None:
        spec = r.spec
        r.next_start, r.reason = None, ""
        try:
            driver = self.driver_for(spec)
        except NotAllowed as exc:   # the node operator's verdict: nothing a retry (or the controller) changes
            return self._fail(r, f"refused: {exc}", retry=False)
        except EngineError as exc:   # an unknown engine: nothing a retry changes
            return self._fail(r, f"no driver for engine {spec.engine!r}: {exc}", retry=False)
        except Exception as exc:     # noqa: BLE001 - a bug in our lookup, not in the spec: see _driver_bug
            return self._driver_bug(r, "finding its driver", exc)
        try:
            ok, why = await self._available(spec, driver)
        except Exception as exc:     # noqa: BLE001 - available() is meant to answer, not raise
            return self._driver_bug(r, "asking whether its engine is available", exc)
        if not ok:
            return self._fail(r, f"engine {spec.engine!r} is not available on this node: {why}", retry=False)
        indices, problem = self._assign_gpus(r)
        if problem:
            # Another replica may free them (a replacement waiting for its old self to stop).
            return self._fail(r, problem, retry=True)
        held = {o.port for o in self.replicas.values() if o is not r and o.port is not None}
        port = await asyncio.to_thread(pick_port, self.ports, self.host, held, r.port)
        if port is None:
            return self._fail(r, f"no free port in {self.ports} on {self.host}", retry=True)
        launch_spec = dataclasses.replace(spec, gpu_indices=indices)
        try:
            launch = driver.launch(launch_spec, host=self.host, port=port)
        except LaunchError as exc:   # the driver's message names what to fix in the profile
            return self._fail(r, f"cannot launch: {exc}", retry=False)
        except Exception as exc:     # noqa: BLE001 - a driver bug is not the spec's fault: see _driver_bug
            return self._driver_bug(r, "building its launch", exc)
        env = {**os.environ, **launch.env}
        # nvidia-smi numbers GPUs by PCI bus; CUDA by default numbers the fastest
        # first. Without this, index 0 in our inventory may be another CUDA device 0.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        try:
            spawned = await asyncio.to_thread(procs.spawn, launch.argv, env, self.log_path(spec.id),
                                              self.state_dir)
        except OSError as exc:   # the executable is missing or not runnable
            return self._fail(r, f"cannot run {launch.argv[0]!r}: {exc}", retry=True)
        r.state, r.gpu_indices, r.port = STARTING, indices, port
        r.pid, r.start_time, r.pgid, r.popen = spawned.pid, spawned.start_time, spawned.pid, spawned.popen
        r.health_path, r.started_at = launch.health_path, self.clock()
        log.info("replica %s: started %s as pid %d on port %d, GPUs %s", spec.id, spec.engine,
                 spawned.pid, port, list(indices) or "none")
        self._changed()

    def _refusal(self, spec: ReplicaSpec) -> str:
        """Why this node refuses to run `spec`'s engine at all, or "" (a lookup that fails otherwise is _start's to report)."""
        try:
            self.driver_for(spec)
        except NotAllowed as exc:
            return f"refused: {exc}"
        except Exception:   # noqa: BLE001 - not a refusal; _start reports it when it tries
            pass
        return ""

    def _fail(self, r: Replica, reason: str, *, retry: bool, exc_info: BaseException | None = None) -> None:
        r.state, r.reason = FAILED, reason
        r.next_start = self.clock() + r.backoff.failure() if retry else None
        log.error("replica %s: %s%s", r.spec.id, reason, "; retrying with backoff" if retry else "", exc_info=exc_info)
        self._changed()

    def _driver_bug(self, r: Replica, doing: str, exc: Exception) -> None:
        """A driver (or lookup) raised something other than an EngineError: a bug, not a verdict on the spec.

        Only a LaunchError or UnknownEngine says "this spec cannot run here";
        anything else (a TypeError from a driver) may be fixed by an upgrade or
        be transient, so it is logged with its traceback and retried with
        backoff, never recorded as a permanent "cannot launch".
        """
        self._fail(r, f"the {r.spec.engine} driver failed while {doing}: {type(exc).__name__}: {exc}", retry=True,
                   exc_info=exc)

    async def _available(self, spec: ReplicaSpec, driver: Driver) -> EngineAvailability:
        key = (spec.engine, spec.command)
        if key not in self._availability:
            self._availability[key] = EngineAvailability(*await asyncio.to_thread(driver.available))
            # An engine the lookup runs that the report does not name yet joins
            # it, so placement learns whether this node can run it. (An agent
            # run by run.py names every catalog engine it allows from its start;
            # a lookup that refuses one never gets here.)
            if spec.engine not in self.engines:
                self.engines[spec.engine] = self._availability[key]
        return self._availability[key]

    def _assign_gpus(self, r: Replica) -> tuple[tuple[int, ...], str]:
        """The replica's GPU indices: the controller's choice, or the lowest free ones."""
        spec = r.spec
        have = {g.index for g in self.gpus}
        others = [o for o in self.replicas.values() if o is not r and o.running]
        taken = {i for o in others for i in o.gpu_indices}
        if spec.gpu_memory_mib:
            # A replica with a memory share may sit beside others that have one:
            # the controller fitted their needs into the GPU's memory. Only a GPU
            # held whole by another replica is off limits to it.
            taken = {i for o in others if not o.spec.gpu_memory_mib for i in o.gpu_indices}
        if spec.gpu_indices:
            wanted = tuple(spec.gpu_indices)
            unknown = [i for i in wanted if i not in have]
            if unknown:
                return (), f"GPU index {unknown} does not exist here (this node has {sorted(have) or 'no GPUs'})"
            busy = [i for i in wanted if i in taken]
            if busy:
                return (), f"GPU {busy} is still held by another replica"
            return wanted, ""
        free = [i for i in sorted(have) if i not in taken]
        if len(free) < spec.gpus:
            return (), f"needs {spec.gpus} GPU(s), {len(free)} free of {len(have)}"
        return tuple(free[:spec.gpus]), ""

    def _stop(self, r: Replica, why: str) -> None:
        log.info("replica %s: stopping: %s", r.spec.id, why)
        previous = r.group_task
        r.state, r.reason, r.next_start = STOPPING, why, None
        r.group_task = asyncio.create_task(self._stop_then_forget(r, previous))
        self._changed()

    async def _stop_then_forget(self, r: Replica, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        await self._terminate(r)
        if self.replicas.get(r.spec.id) is r:
            del self.replicas[r.spec.id]
        self._changed()
        self.wake()   # a replacement may be waiting for this id, port or GPUs

    async def _terminate(self, r: Replica, detach: bool = False) -> None:
        """SIGTERM the replica's group, SIGKILL what is left after the grace period, reap.

        `detach` (after a crash) forgets the process afterwards, keeping the
        replica's port and counters for the restart.
        """
        pgid, started, popen = r.pgid, r.start_time, r.popen
        if pgid is not None and started is not None:
            if await asyncio.to_thread(procs.group_is_ours, pgid, started):
                await self._signal_and_wait(r.spec.id, pgid, popen)
            else:
                log.warning("replica %s: pid %d is now another process; not signalling it", r.spec.id, pgid)
        if popen is not None:
            popen.poll()   # reap the leader; one stuck past SIGKILL is reaped by Popen's own cleanup later
        if detach or r.state == STOPPING:
            r.pid = r.start_time = r.pgid = None
            r.popen = None
            self._changed()

    async def _signal_and_wait(self, rid: str, pgid: int, popen: subprocess.Popen | None) -> None:
        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, KILL_WAIT)):
            if not await asyncio.to_thread(procs.signal_group, pgid, sig):
                return
            deadline = self.clock() + wait
            while True:
                if popen is not None:
                    popen.poll()   # reap the leader as soon as it exits, or it lingers as a zombie
                if not await asyncio.to_thread(procs.group_members, pgid):
                    return
                if self.clock() >= deadline:
                    break
                await asyncio.sleep(0.1)
            if sig == signal.SIGTERM:
                log.warning("replica %s: still running %.0fs after SIGTERM; sending SIGKILL", rid, wait)
        log.error("replica %s: process group %d survived SIGKILL (stuck in the kernel?)", rid, pgid)

    # -- bookkeeping --------------------------------------------------------

    def _changed(self) -> None:
        self.on_change()

    async def _housekeeping(self) -> None:
        paths = [self.log_path(r.spec.id) for r in self.replicas.values() if r.running]
        await asyncio.to_thread(lambda: [procs.rotate_log(p) for p in paths])
        await self._save_state()

    async def _save_state(self) -> None:
        records = [rec for r in self.replicas.values() if (rec := r.record()) is not None]
        docs = [rec.to_dict() for rec in records]
        if docs == self._saved:
            return
        await asyncio.to_thread(state.save, self.state_dir, self.machine_boot, records, self.instance_id)
        self._saved = docs

    def report(self) -> AgentReport:
        """The report the controller receives: who this node is and everything it runs."""
        return AgentReport(
            node=self.node, agent_version=__version__, advertise_host=self.host,
            # Identity (see inventory.Inventory._claim): which process speaks for
            # the node, on which machine boot, succeeding which process.
            instance_id=self.instance_id, boot_id=self.machine_boot, previous_instance_id=self.previous_instance_id,
            pools=self.pools, engines=MappingProxyType(dict(sorted(self.engines.items()))), gpus=self._gpus_now(),
            replicas=tuple(self._replica_report(r) for r in sorted(self.replicas.values(), key=lambda r: r.spec.id)),
            cpu=self.cpu,
        )

    def _gpus_now(self) -> tuple[Gpu, ...]:
        """The GPUs with free memory as it stands: what discovery read, less our memory shares since.

        Free memory is read once, when the agent starts (nvidia-smi, or the
        simulated SPEC). Each replica running with a memory share is taken
        off it, as the engine allocates its share: without that, placement
        would see a GPU as free as it was before anything started and could
        overfill it. A replica adopted at start was already in the figure, so
        it counts twice until the agent restarts; that errs towards not
        sharing, never towards overcommitting.
        """
        used: dict[int, int] = {}
        for r in self.replicas.values():
            if r.running and r.spec.gpu_memory_mib:
                for i in r.gpu_indices or r.spec.gpu_indices:
                    used[i] = used.get(i, 0) + r.spec.gpu_memory_mib
        if not used:
            return self.gpus
        return tuple(dataclasses.replace(g, memory_free_mib=max(0, g.free_mib - used[g.index]))
                     if g.index in used and g.memory_mib else g for g in self.gpus)

    def _replica_report(self, r: Replica) -> ReportedReplica:
        return ReportedReplica(
            id=r.spec.id, spec_hash=r.spec.spec_hash, model=r.spec.model, profile=r.spec.profile,
            engine=r.spec.engine, gpu_indices=r.gpu_indices or r.spec.gpu_indices, port=r.port,
            pid=r.pid, state=r.state, restarts=r.restarts, last_exit=r.last_exit,
            last_log=tuple(r.last_log), url=self.url(r.port) if r.port is not None else None,
            reason=r.reason,
            # The whole spec, so a restarted controller can adopt this replica
            # and keep desiring exactly it (same hash) until it decides to
            # replace it, instead of the agent restarting it on a guessed spec.
            spec=r.spec,
        )


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown status (not our child)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
