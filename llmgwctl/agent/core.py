"""The agent's core: converge the engines on this node to the desired replicas.

Owns the replicas this node runs and their life (starting, ready, failed,
stopping), one process group each. Level-triggered: `reconcile_once()` looks
at what runs and what is desired and does what differs -- start what is
desired and missing, stop what runs and is no longer desired, replace what
runs with another spec hash, restart what crashed once its backoff is over,
and probe the engines' health: a starting one until it passes, a ready one
while it runs (health.py), so one that stops answering is reported not ready.
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
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

import aiohttp

from .. import __version__
from ..aio import cancel_and_wait, sleep_unless
from ..contracts import AgentReport, CpuCapacity, EngineAvailability, Gpu, ReplicaSpec
from ..engines.errors import EngineError, LaunchError, NotAllowed
from ..engines.spec import Driver
from . import gpushare, members, procs, state
from .adapters import AdapterKeeper
from .backoff import restart_schedule
from .groups import STOP_GRACE, clear_leftovers, stop_if_ours
from .health import DEFAULT_POLICY, TICK, HealthPolicy, Prober, missed, next_probe
from .ports import PortRange, pick_port
from .replica import FAILED, READY, STARTING, STOPPING, Replica, describe_exit

__all__ = ["Agent", "FAILED", "READY", "Replica", "STARTING", "START_TIMEOUT", "STOP_GRACE", "STOPPING", "TICK"]

log = logging.getLogger("llmgw.agent")

# 10 min to pass health after launch: vLLM loading a 70B model from local disk
# and capturing CUDA graphs takes several minutes; longer than this is a hang
# (a stuck download, a deadlocked NCCL init) that a restart may clear.
START_TIMEOUT = 600.0

DriverLookup = Callable[[ReplicaSpec], Driver]


class Agent:
    def __init__(self, *, node: str, gpus: Iterable[Gpu], state_dir: Path, ports: PortRange,
                 driver_for: DriverLookup, session: aiohttp.ClientSession, host: str = "127.0.0.1",
                 pools: Iterable[str] = (), engines: Mapping[str, tuple[bool, str]] | None = None,
                 start_timeout: float = START_TIMEOUT, grace: float = STOP_GRACE,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, cpu: CpuCapacity | None = None,
                 health: HealthPolicy = DEFAULT_POLICY):
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
        self.health = health
        self.prober = Prober(session, host, health.timeout)
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
        self._availability: dict[tuple[str, tuple[str, ...] | None], EngineAvailability] = {}
        self._saved: list[dict[str, object]] | None = None
        # LoRA adapters on the ready engines (adapters.py): loaded in the background, reported on change.
        self.adapters = AdapterKeeper(session, on_change=self._changed, clock=clock)

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

    def _local_url(self, port: int) -> str:
        """Where this agent itself calls an engine: loopback for one bound to every address, as the prober does."""
        return self.url(port) if self.host not in ("0.0.0.0", "::") else f"http://127.0.0.1:{port}"

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
                await clear_leftovers(rec.spec.id, rec.pgid, self.grace, self.clock)
                continue
            # A worker has no health to probe, only its time running: one that outlived the last run
            # of this agent has run past WORKER_SETTLE, so it is ready at once, and its group serves on.
            started = now if members.serves_api(rec.spec) else now - members.WORKER_SETTLE
            self.replicas[rec.spec.id] = Replica(
                spec=rec.spec, backoff=restart_schedule(self.clock), state=STARTING,
                gpu_indices=rec.spec.gpu_indices, port=rec.port, pid=rec.pid, start_time=rec.start_time,
                pgid=rec.pgid, health_path=rec.health_path, started_at=started, restarts=rec.restarts)
            adopted.append(rec.spec.id)
            log.info("replica %s: adopted pid %d %s", rec.spec.id, rec.pid,
                     f"on port {rec.port}" if rec.port is not None else "with no port (a group's worker)")
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

    # -- the pass -----------------------------------------------------------

    async def reconcile_once(self) -> None:
        """One level-triggered pass: observe processes, probe, then converge on desired."""
        await self._observe_exits()
        await asyncio.gather(self._probe_starting(), self._probe_ready())
        if self.desired is not None:
            await self._converge(self.desired)
        self.adapters.sync(self.replicas.values(), self._local_url)
        await self._housekeeping()

    async def run(self, stop: asyncio.Event, tick: float = TICK) -> None:
        """Reconcile every `tick` seconds or when woken, until `stop` is set; probe starting engines between.

        Between passes only the starting engines whose next probe is due are
        probed (health.PROBE_SHARE): one that turns healthy is ready, and reported,
        at once instead of at the next pass.
        """
        next_pass = self.clock()
        while not stop.is_set():
            try:
                if self._wake.is_set() or self.clock() >= next_pass:
                    self._wake.clear()
                    began = self.clock()
                    await self.reconcile_once()
                    # A tick from the pass's start: a pass that waited out a
                    # wedged engine's probe timeout is not followed by a whole
                    # tick more, so its failed probes come once a tick.
                    next_pass = began + tick
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
        await self.adapters.close()
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
            await self._crashed(r, code, f"engine exited with {describe_exit(code)}")

    async def _crashed(self, r: Replica, code: int | None, reason: str) -> None:
        r.last_exit = code
        r.last_log = await asyncio.to_thread(procs.tail, self.log_path(r.spec.id))
        delay = r.backoff.failure()
        r.next_start = self.clock() + delay
        r.state, r.reason = FAILED, reason
        r.misses, r.unhealthy_since = 0, None
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
        # A group's worker has no API to probe (members.py): it is ready once it has run a while.
        results = await asyncio.gather(*(self.prober.probe(r) for r in starting if members.serves_api(r.spec)))
        now = self.clock()
        verdicts = iter(results)
        restart_after = self.health.restart_after
        for r in starting:
            why = next(verdicts) if members.serves_api(r.spec) else members.settling(r, now)
            if r.state != STARTING:
                continue
            r.next_probe = next_probe(r, now) if members.serves_api(r.spec) else r.started_at + members.WORKER_SETTLE
            if not why:
                log.info("replica %s: %s at %s (pid %d)", r.spec.id,
                         "ready" if r.unhealthy_since is None else "healthy again, ready",
                         self.url(r.port) if r.port is not None else "no address (a group's worker)", r.pid)
                r.state, r.reason, r.misses, r.unhealthy_since = READY, "", 0, None
                r.backoff.ready()
                self._changed()
            elif r.unhealthy_since is not None:
                # Once ready, then silent: its bound runs from when it went
                # silent; its start timeout was for loading, long over.
                if restart_after and now - r.unhealthy_since > restart_after:
                    await self._crashed(r, None, f"unhealthy: its health check did not pass for {restart_after:g} s "
                                                 f"(last {why})")
            elif now - r.started_at > self.start_timeout:
                await self._crashed(r, None, f"not healthy within {self.start_timeout:.0f}s of starting")

    async def _probe_ready(self) -> None:
        """Probe the ready engines' health; one failing too often in a row is reported not ready (health.py)."""
        policy = self.health
        ready = [r for r in self.replicas.values()
                 if r.state == READY and r.pid is not None and members.serves_api(r.spec)]
        if not ready or not policy.unhealthy_after:
            return
        began = self.clock()
        results = await asyncio.gather(*(self.prober.probe(r) for r in ready))
        now = self.clock()
        for r, why in zip(ready, results):
            if r.state != READY:
                continue
            if not why:
                r.misses = 0
                continue
            reason = missed(r, why, now, now - began, policy)
            if reason:
                # Back to starting: out of the router's list through the
                # controller, probed every pass, ready again when it passes.
                r.state, r.reason, r.unhealthy_since, r.next_probe = STARTING, reason, r.first_miss, now
                log.warning("replica %s: %s", r.spec.id, reason,
                            extra={"event": "replica-unhealthy", "replica": r.spec.id})
                self._changed()

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
            elif spec.adapters != r.spec.adapters:
                # Adapters are outside the hash: the running engine loads and
                # unloads them (adapters.py), it is not replaced.
                r.spec = dataclasses.replace(r.spec, adapters=spec.adapters)
                self._changed()
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
        r.next_start, r.reason, r.misses, r.unhealthy_since = None, "", 0, None
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
        indices, problem = gpushare.assign(r, self.gpus, self.replicas.values())
        if problem:
            # Another replica may free them (a replacement waiting for its old self to stop).
            return self._fail(r, problem, retry=True)
        port: int | None = None
        if members.serves_api(spec):
            # Not a port another engine holds, nor one a group's rendezvous was given (members.py).
            held = {o.port for o in self.replicas.values() if o is not r and o.port is not None}
            held |= members.group_ports([*(o.spec for o in self.replicas.values()), *(self.desired or ())])
            port = await asyncio.to_thread(pick_port, self.ports, self.host, held, r.port)
            if port is None:
                return self._fail(r, f"no free port in {self.ports} on {self.host}", retry=True)
        launch_spec = dataclasses.replace(spec, gpu_indices=indices)
        try:
            launch = driver.launch(launch_spec, host=self.host, port=port or 0)
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
        log.info("replica %s: started %s as pid %d %s, GPUs %s", spec.id, spec.engine, spawned.pid,
                 f"on port {port}" if port is not None else "with no port (a group's worker)", list(indices) or "none")
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

    def _stop(self, r: Replica, why: str) -> None:
        log.info("replica %s: stopping: %s", r.spec.id, why)
        previous = r.group_task
        r.state, r.reason, r.next_start = STOPPING, why, None
        r.group_task = asyncio.create_task(self._stop_then_forget(r, previous))
        self._changed()

    async def _stop_then_forget(self, r: Replica, previous: asyncio.Task[None] | None) -> None:
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
            await stop_if_ours(r.spec.id, pgid, started, popen, self.grace, self.clock)
        if popen is not None:
            popen.poll()   # reap the leader; one stuck past SIGKILL is reaped by Popen's own cleanup later
        if detach or r.state == STOPPING:
            r.pid = r.start_time = r.pgid = None
            r.popen = None
            self._changed()

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
            pools=self.pools, engines=MappingProxyType(dict(sorted(self.engines.items()))),
            gpus=gpushare.free_now(self.gpus, self.replicas.values()),
            replicas=tuple(r.report(self.url(r.port) if r.port is not None else None, self.adapters.statuses(r))
                           for r in sorted(self.replicas.values(), key=lambda r: r.spec.id)),
            cpu=self.cpu,
        )
