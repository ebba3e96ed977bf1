"""Wiring one agent process: discovery, adoption, the reconcile loop and its input/output loops.

Owns the process-level pieces -- the event loop, the one shared aiohttp
session, signal handling, which desired source is used -- and nothing of the
logic: that is in core (replicas), controller (protocol) and desired (files).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .. import aio
from ..contracts import ReplicaSpec
from ..engines.custom import NOTHING_ALLOWED, AllowedEngines
from ..engines.spec import Driver
from . import state
from .capacity import cpu_capacity
from .controller import HEARTBEAT, ControllerClient, desired_loop, file_loop, report_loop
from .core import START_TIMEOUT, STOP_GRACE, TICK, Agent
from .desired import DesiredFile
from .gpus import discover
from .health import DEFAULT_POLICY, HealthPolicy
from .logs import LogSender
from .ports import PortRange

log = logging.getLogger("llmgw.agent")


@dataclass(frozen=True)
class AgentConfig:
    node: str
    state_dir: Path
    ports: PortRange
    gpus: str = "auto"                     # auto | none | SPEC
    pools: tuple[str, ...] = ()
    # Loopback unless told otherwise: an engine has no authentication of its
    # own, so it is reachable from other machines only when the operator says so.
    host: str = "127.0.0.1"
    controller: str | None = None
    desired_file: Path | None = None
    token: str | None = None
    grace: float = STOP_GRACE
    start_timeout: float = START_TIMEOUT
    health: HealthPolicy = DEFAULT_POLICY   # how ready engines are probed and judged (health.py)
    tick: float = TICK
    heartbeat: float = HEARTBEAT
    # No catalog-defined engine, and no engine option that runs code, unless the
    # node's operator allows it: the catalog's writers decide the model list,
    # not what executes on this machine.
    allow_engines: AllowedEngines = NOTHING_ALLOWED
    # The most replicas with no GPU placement puts here; None: the default
    # from the machine's cores and memory (agent.capacity).
    max_cpu_replicas: int | None = None


def _default_drivers(allowed: AllowedEngines) -> tuple[Callable[[ReplicaSpec], Driver],
                                                      Callable[[], Mapping[str, tuple[bool, str]]]]:
    from .. import engines
    return (functools.partial(engines.driver_for, allowed=allowed),
            functools.partial(engines.available_engines, allowed=allowed))


async def run_agent(cfg: AgentConfig, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set (or SIGTERM/SIGINT when run by `main`). Engines keep running after."""
    stop = stop or asyncio.Event()
    # First: a second agent on this state directory would adopt and signal the
    # same engines as the first (StateLockedError, before anything is touched).
    held = await asyncio.to_thread(state.lock, cfg.state_dir)
    try:
        await _run(cfg, stop)
    finally:
        held.close()


async def _run(cfg: AgentConfig, stop: asyncio.Event) -> None:
    driver_for, available_engines = _default_drivers(cfg.allow_engines)
    gpus = await asyncio.to_thread(discover, cfg.gpus, cfg.node)
    engines = await asyncio.to_thread(available_engines)
    cpu = cpu_capacity(cfg.ports, cfg.max_cpu_replicas)
    changed = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        agent = Agent(node=cfg.node, gpus=gpus, state_dir=cfg.state_dir, ports=cfg.ports, host=cfg.host,
                      pools=cfg.pools, engines=engines, driver_for=driver_for, session=session,
                      start_timeout=cfg.start_timeout, grace=cfg.grace, on_change=changed.set, cpu=cpu,
                      health=cfg.health)
        log.info("agent %s: %d GPU(s), %d core(s), at most %d CPU replica(s); engines available: %s", cfg.node,
                 len(gpus), cpu.cores, cpu.max_replicas,
                 ", ".join(n for n, (ok, _) in sorted(engines.items()) if ok) or "none")
        if cfg.allow_engines.pins:
            log.info("agent %s: catalog engines allowed here: %s", cfg.node,
                     ", ".join(f"{n}={p}" for n, p in cfg.allow_engines.pins.items()))
        if cfg.allow_engines.args:
            log.info("agent %s: engine options that run code allowed here: %s", cfg.node,
                     ", ".join(f"--{name}" for name in sorted(cfg.allow_engines.args)))
        await agent.adopt()
        tasks = []
        logs: LogSender | None = None
        if cfg.desired_file is not None:
            follow = DesiredFile(cfg.desired_file)
            # Read the file before the first pass, so a restarted agent does not
            # spend a pass with "desired unknown" when the answer is on disk.
            first = await asyncio.to_thread(follow.poll)
            if first is not None:
                agent.set_desired(first)
            tasks.append(asyncio.create_task(file_loop(follow, agent, stop), name="desired-file"))
        if cfg.controller is not None:
            client = ControllerClient(cfg.controller, cfg.node, session, cfg.token, agent.instance_id)
            logs = LogSender(client, agent.log_path, lambda rid: rid in agent.replicas, stop)
            client.on_log_requests = logs.handle
            reported = asyncio.Event()
            tasks.append(asyncio.create_task(report_loop(client, agent.report, changed, stop, cfg.heartbeat, reported),
                                             name="report"))
            if cfg.desired_file is None:
                tasks.append(asyncio.create_task(desired_loop(client, agent, stop, reported), name="desired"))
        tasks.append(asyncio.create_task(agent.run(stop, cfg.tick), name="reconcile"))
        try:
            await stop.wait()
        finally:
            await aio.cancel_and_wait(*tasks)
            if logs is not None:
                await logs.close()
            await agent.close()
        # Say what is actually left: `serve` stops its local engines before its agent.
        running = sum(r.running for r in agent.replicas.values())
        if running:
            log.info("agent %s stopped; its %d engine(s) keep running and the next agent adopts them", cfg.node, running)
        else:
            log.info("agent %s stopped; no engine left running", cfg.node)


def main(cfg: AgentConfig) -> None:
    """Run an agent in this process until SIGTERM or SIGINT."""
    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_agent(cfg, stop)

    aio.run(_main())
