"""`llmgwctl serve`: controller + router + control API (+ this machine's agent) in one process.

Start order: load the catalog (refuse to start on an invalid one: there is no
last good catalog yet, and starting empty would stop every adopted replica),
control API up (agents can report), local agent in-process, router up, then
the reconcile loop and the watcher.

Stop order (SIGINT/SIGTERM): stop accepting new requests on the router, let
requests in flight finish (SHUTDOWN_DRAIN), stop the reconcile loop and the
watcher (so nothing is placed from here on), then, with a local agent, tell it
to run nothing and wait for its engines to stop (SHUTDOWN_ENGINES), then the
rest (SHUTDOWN_LOOPS): serve is gone within SHUTDOWN_GRACE of the signal. The
reconcile loop stops first because a pass would see the local replicas
stopping and place them again on a remote node on the way out, and the next
start would adopt that drift. Engines of remote agents are left running as
they are: a restarted controller adopts them.

Security (see `auth`): the control API refuses to bind beyond loopback without
a token; with one, the local agent presents its node's token (minted from the
agent token; the admin token when there is none). Router API keys
(`api_keys`) are loaded before the router listens, so it never serves a
moment open, and followed for edits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..engines.custom import NOTHING_ALLOWED, AllowedEngines
from ..httporigin import BrowserGuard
from ..httpserver import ConnectionGuard, bound_port, json_errors, server_options
from ..observability.metrics import ControlMetrics
from . import holds, revocations
from .api import ControlAPI
from .auth import MAX_TOKEN_GPUS, ControlAuth, check_bind, node_token
from .controller import Controller
from .errors import ControlError

if TYPE_CHECKING:
    from ..router import RouterConfig

log = logging.getLogger("llmgw.serve")

# Requests in flight get this long to finish when serve stops: a typical chat
# completion streams in well under it, and a supervisor's stop timeout (systemd's
# default is 90 s) leaves room for the engine shutdown that follows. Past it the
# router cancels them (a stream's client sees its connection close).
SHUTDOWN_DRAIN = 30.0
# Then the local agent's engines get this long to stop: twice an agent's 15 s
# between SIGTERM and SIGKILL, so even an engine that ignores SIGTERM is gone.
SHUTDOWN_ENGINES = 30.0
# And the loops (reconciler, watcher, agent, key file) this long to end once
# told: each ends within one wait; past it they are cancelled.
SHUTDOWN_LOOPS = 5.0
# So serve exits within this of SIGTERM whatever is in flight: 65 s, inside
# systemd's default 90 s stop timeout (llmgwctl-serve(1) says so).
SHUTDOWN_GRACE = SHUTDOWN_DRAIN + SHUTDOWN_ENGINES + SHUTDOWN_LOOPS
# Open control API connections per client address (0: no limit). Not the
# router's 256 (httpserver.MAX_CONNECTIONS_PER_CLIENT): every agent holds two
# at all times -- its desired long-poll and its report's keep-alive -- and a
# fleet behind one NAT address or one load balancer reaches the controller
# from that one address, so 256 refused the 129th agent. 4096 carries 2,000 agents per address
# and still bounds what one stranger can hold to a small share of the file
# descriptors serve raises its limit to. Larger fleets behind one address:
# raise it (--control-connections-per-client) or set 0.
CONTROL_CONNECTIONS_PER_CLIENT = 4096
# Connections the kernel queues for the control API before serve accepts
# them. After a controller restart every agent of the fleet reconnects within
# one retry interval, thousands at once at fleet size; aiohttp's default (128)
# makes the kernel drop the rest of a burst's SYNs, and each dropped agent
# waits out a SYN retransmit (1 s, then 3 s, 7 s) or its report's timeout,
# late for the settling window. The kernel caps it at net.core.somaxconn
# (4096 on current kernels).
CONTROL_BACKLOG = 4096


class ServeError(ControlError):
    """`serve` cannot start as configured; the message names the address or file and why."""


@dataclass
class ServeConfig:
    catalogs: str = "catalogs"
    listen: tuple[str, int] = ("127.0.0.1", 8080)
    control: tuple[str, int] = ("127.0.0.1", 8081)
    local_agent: bool = True
    gpus: str = "auto"
    pools: tuple[str, ...] = ()
    state_dir: Path = field(default_factory=lambda: Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "llmgw")
    node: str = field(default_factory=socket.gethostname)
    ports: str = "20000-20999"
    max_cpu_replicas: int | None = None     # the local agent's; None: its default from cores and memory
    settle: float | None = None
    drain_grace: float | None = None
    node_timeout: float | None = None
    replace_after: float | None = None
    tick: float | None = None
    stop_engines_on_exit: bool = True
    token: str | None = None                # the control API's admin token; None: open, loopback only
    agent_token: str | None = None          # routers' token (watch, usage, wake) and the secret node tokens are signed with
    api_keys: str | None = None             # the router's API key file; None: the router is open
    router: RouterConfig | None = None    # the data plane's knobs (access log included); None: the defaults
    control_connections_per_client: int = CONTROL_CONNECTIONS_PER_CLIENT    # 0: no limit
    allow_engines: AllowedEngines = NOTHING_ALLOWED   # the local agent's catalog engines (see AgentConfig)
    # Web origins that may call the control API besides its own (the console's);
    # none by default, as nothing but the console and the CLI has reason to.
    # The Host names it answers to are the router's (`router.allowed_hosts`).
    control_cors_origins: tuple[str, ...] = ()
    # Node tokens from before claims claim what their reports say (auth): for the upgrade of a fleet only.
    legacy_node_tokens: bool = False
    node_revocations: str | None = None     # NODE [SERIAL] lines, followed (control.revocations); None: none revoked


class Server:
    """A running serve: `start()` binds everything, `stop()` shuts it down in order."""

    def __init__(self, cfg: ServeConfig):
        from ..router import Router, RouterConfig

        self.cfg = cfg
        # Only what was set: an option left None keeps the reconciler's own default.
        # Typed Any, as Controller's **reconciler_options are: mypy checks a
        # **dict[str, float] against every keyword of Controller, its clocks too.
        options: dict[str, Any] = {
            k: v for k, v in (("settle", cfg.settle), ("drain_grace", cfg.drain_grace),
                              ("node_timeout", cfg.node_timeout), ("replace_after", cfg.replace_after)) if v is not None}
        self.router = Router(waker=self, config=cfg.router or RouterConfig())
        self.controller = Controller(cfg.catalogs, router=self.router, **options)
        self.stop_event = asyncio.Event()       # stops the controller's loops: set last
        self.shutdown = asyncio.Event()         # SIGINT/SIGTERM: begin the ordered stop
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._agent_stop = asyncio.Event()
        self._controller_task: asyncio.Task[None] | None = None
        self.router_port = 0
        self.control_port = 0

    def _router_url(self) -> str | None:
        """Where this process's router listens, as the playground reaches it (None until it does)."""
        if not self.router_port:
            return None
        host = self.cfg.listen[0]
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        return f"http://[{host}]:{self.router_port}" if ":" in host else f"http://{host}:{self.router_port}"

    def wake(self, model_name: str) -> None:
        """The router's Waker (built before the controller exists, so this forwards)."""
        self.controller.wake(model_name)

    async def start(self) -> None:
        from ..router.server import start as start_router

        check_bind(self.cfg.control[0], self.cfg.token)      # TokenError before anything binds
        auth = ControlAuth(self.cfg.token, self.cfg.agent_token, legacy_node_tokens=self.cfg.legacy_node_tokens)
        if self.cfg.node_revocations:
            # Read before the control API listens, so a revoked token is never
            # taken for a moment; a list that cannot be read stops the start
            # (RevocationFileError), as an invalid catalog does.
            auth.revocations = await asyncio.to_thread(revocations.load, self.cfg.node_revocations)
            followed = revocations.Followed(self.cfg.node_revocations)
            self.controller.followed.append(followed.status)     # status' `watchers`
            self._tasks.append(asyncio.create_task(
                revocations.follow_revocations(auth, self.cfg.node_revocations, self.stop_event,
                                               on_change=self.controller.revocations_changed, followed=followed),
                name="node-revocations"))
        metrics = ControlMetrics(self.controller.state)
        self.controller.reconciler.on_pass = metrics.observe_pass
        # The operator's cordons and drains, back before any pass can place on
        # a held node; a file that cannot be read stops the start (holds).
        held_at = holds.path_in(self.cfg.state_dir)
        restored = await asyncio.to_thread(holds.load, held_at)
        if restored:
            self.controller.reconciler.restore_holds(restored)
            log.info("node holds from %s: %s", held_at, ", ".join(
                f"{node} {'draining' if drain else 'cordoned'}" for node, drain in sorted(restored.items())))
        catalog = await asyncio.to_thread(self.controller.load)
        # The router is already the reconciler's endpoint sink (Controller(router=...)):
        # registering it again would push every endpoint and model-state change to it twice.
        self.router.set_catalog(catalog)
        if self.cfg.api_keys:
            from ..router.auth import follow_keys
            keys = follow_keys(self.router, self.cfg.api_keys, self.stop_event)
            self._tasks.append(keys.task)
            self.controller.followed.append(keys.status)     # status' `watchers`
        # Long-polls (agents, standalone routers) are cut at shutdown rather than
        # waited for: their clients retry, and they would hold the exit for 30 s.
        # Idle and header limits: the shared defaults (see httpserver), which
        # long-polls answering within 30 s fit under.
        # Web pages of other origins and Host names a page could have pointed
        # here are refused before the token is looked at (see httporigin).
        browsers = BrowserGuard.for_bind(self.cfg.control[0], server="control API",
                                         cors_origins=self.cfg.control_cors_origins,
                                         allowed_hosts=self.router.config.allowed_hosts,
                                         cors_option="--control-cors-origin")
        runner = web.AppRunner(ControlAPI(self.controller, auth=auth, metrics=metrics, holds=held_at,
                                          router_url=self._router_url).app(browsers),
                               access_log=None, shutdown_timeout=0.5, **server_options())
        await runner.setup()
        json_errors(runner.server)      # aiohttp's own refusals and the unexpected, in JSON like the rest
        # Beyond loopback strangers reach it too (and get 401): a cap per address,
        # so they cannot hold every socket either; its own, sized for agents
        # behind one address (see CONTROL_CONNECTIONS_PER_CLIENT).
        self.connections = ConnectionGuard(self.cfg.control_connections_per_client)
        self.connections.install(runner.server)
        site = web.TCPSite(runner, *self.cfg.control, backlog=CONTROL_BACKLOG)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ServeError(f"the control API cannot listen on {_address(self.cfg.control)}: "
                             f"{exc.strerror or exc}") from exc
        self._runners.append(runner)
        self.control_port = bound_port(runner)
        log.info("control API on http://%s:%d", self.cfg.control[0], self.control_port)
        if self.cfg.local_agent:
            self._tasks.append(asyncio.create_task(self._run_local_agent(), name="local-agent"))
        try:
            router_runner, self.router_port = await start_router(self.router, *self.cfg.listen,
                                                                 shutdown_timeout=SHUTDOWN_DRAIN)
        except OSError as exc:
            raise ServeError(f"the router cannot listen on {_address(self.cfg.listen)}: "
                             f"{exc.strerror or exc}") from exc
        self._runners.insert(0, router_runner)
        log.info("router on http://%s:%d/v1 serving catalog %s (%d models)", self.cfg.listen[0], self.router_port,
                 catalog.version, len(catalog))
        self._controller_task = asyncio.create_task(self.controller.run(self.stop_event, self.cfg.tick), name="controller")
        self._tasks.append(self._controller_task)

    async def _run_local_agent(self) -> None:
        from ..agent.errors import StateLockedError
        from ..agent.ports import PortRange
        from ..agent.run import AgentConfig, run_agent

        host = self.cfg.control[0] if self.cfg.control[0] not in ("0.0.0.0", "::", "") else "127.0.0.1"
        # In-process, but it speaks the agent protocol like any other agent: as
        # its node, with the node token the agent secret mints for it.
        cfg = AgentConfig(node=self.cfg.node, state_dir=Path(self.cfg.state_dir), ports=PortRange.parse(self.cfg.ports),
                          gpus=self.cfg.gpus, pools=tuple(self.cfg.pools),
                          controller=f"http://{host}:{self.control_port}",
                          allow_engines=self.cfg.allow_engines, max_cpu_replicas=self.cfg.max_cpu_replicas)
        # Its claims are what serve was told of this machine: its pools, any
        # GPU count (the local agent finds them itself), and the host its
        # engines bind to, which is not the address its reports come from
        # when the control API listens on another of this machine's addresses.
        cfg = dataclasses.replace(cfg, token=node_token(self.cfg.agent_token, self.cfg.node, pools=tuple(self.cfg.pools),
                                                        max_gpus=MAX_TOKEN_GPUS, advertise_host=cfg.host)
                                  if self.cfg.agent_token else self.cfg.token)
        try:
            await run_agent(cfg, self._agent_stop)
        except StateLockedError as exc:
            log.error("no local agent: %s", exc)

    async def stop(self) -> None:
        router_runner = self._runners[0] if self._runners else None
        if router_runner is not None and len(self._runners) > 1:
            # 1. No new requests: close the router's listening socket, let the ones
            #    in flight finish (aiohttp waits for handlers up to the timeout).
            await router_runner.shutdown()
            await _drain(router_runner)
            self._runners.pop(0)
        # 2. Nothing placed from here on: the reconcile loop and the watcher stop
        #    (see the module docstring for why before the local engines).
        self.stop_event.set()
        if self._controller_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._controller_task), SHUTDOWN_LOOPS)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down regardless
                self._controller_task.cancel()
        # 3. The local engines, while the control API still takes the agent's reports.
        if self.cfg.local_agent and self.cfg.stop_engines_on_exit:
            await self._stop_local_engines()
        self._agent_stop.set()
        # All loops at once, bounded together: one that does not end in time is
        # cancelled, so the exit never waits on the slowest of them in turn.
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=SHUTDOWN_LOOPS)
            for task in late:
                log.warning("%s did not stop within %.0f s of being told; cancelling it", task.get_name(), SHUTDOWN_LOOPS)
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for runner in self._runners:
            await runner.cleanup()

    async def _stop_local_engines(self) -> None:
        """Tell this machine's agent to run nothing, and wait until it reports nothing running."""
        node = self.cfg.node
        self.controller.reconciler.stop_node(node)      # publishes the node's empty list itself
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_ENGINES
        while loop.time() < deadline:
            reported = self.controller.inventory.get(node)
            if reported is None or not reported.replicas:
                return
            await asyncio.sleep(0.1)
        log.warning("local engines still running after %.0fs; leaving them for the next start to adopt", SHUTDOWN_ENGINES)


async def _drain(runner: web.AppRunner) -> None:
    """`runner.cleanup()`, with requests in flight cut once SHUTDOWN_DRAIN is over.

    aiohttp waits its shutdown timeout for handlers to finish, then asks them
    to stop and waits that long again: a proxied stream waiting on its engine
    never hears the ask, so alone it would hold the exit for twice the drain.
    Closing the connections instead cancels their handlers at once (the router
    runs with handler_cancellation), which also closes their engine requests.
    """
    cleanup = asyncio.ensure_future(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=SHUTDOWN_DRAIN + 1.0)
    if done:
        return cleanup.result()
    server = runner.server
    connections = list(server.connections) if server is not None else []
    log.warning("%d connection(s) still busy %.0f s after shutdown began; closing them", len(connections),
                SHUTDOWN_DRAIN)
    for conn in connections:
        conn.force_close()
    done, _ = await asyncio.wait({cleanup}, timeout=SHUTDOWN_LOOPS)
    if not done:
        cleanup.cancel()
        log.warning("the router did not finish stopping %.0f s after its connections were closed", SHUTDOWN_LOOPS)


def _address(host_port: tuple[str, int]) -> str:
    host, port = host_port
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# The cyclic collector's defaults (700, 10, 10) suit small programs. A
# controller holds a fleet -- at 5,000 nodes 20,000 replica records and the
# nodes' reports, ~600,000 tracked objects -- and a reconcile pass's
# short-lived lists and tuples, alive across two young collections within
# the pass, were promoted and made a full collection of every live object
# come every second or third pass. A young collection every 50,000 net
# allocations instead of 700 lets a pass's garbage die young, and no full
# collection comes in a steady run (bench/README.md, "GC thresholds in
# serve", has the passes before and after). Cycles are still collected,
# only in larger batches; memory barely moves (a young generation of 50,000
# objects is a few MiB).
GC_THRESHOLDS = (50_000, 20, 20)


async def serve(cfg: ServeConfig, ready: asyncio.Future[Server] | None = None) -> None:
    """Run until SIGINT/SIGTERM. Raises CatalogError, KeyFileError or a ControlError when it cannot start."""
    gc.set_threshold(*GC_THRESHOLDS)
    server = Server(cfg)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.shutdown.set)
    if ready is not None:
        ready.set_result(server)
    await server.shutdown.wait()
    log.info("shutting down: no new requests, draining, stopping local engines")
    await server.stop()
