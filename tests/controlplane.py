"""The real control plane on loopback, for tests of its clients: the agent and the standalone router.

`ControlPlane` serves the real `ControlAPI` over a real `Controller` on
127.0.0.1, so a client is tested against the protocol as the controller
implements it, schema checks and long-poll holds included, not against a copy
of it. The reconcile loop and the catalog watcher are not started: a test moves
the controller through the surfaces those loops use -- `controller.desired.set`,
`controller.live.swap`, `controller.reconciler.reconcile_once()` -- one
deterministic step at a time (DESIGN.md "Deterministic entry points").

Around the API sits one thin middleware that records what clients sent, as the
controller received it (accepted reports and their headers, the desired
long-polls' queries, accepted wakes), and two switches:

- `hold`: every long-poll is held at most this long. It is asked for the way
  any client may ask (`?timeout=`, which the API honours up to its own 30 s),
  so a test sees several polls without waiting half a minute for each.
- `fail_status`: while set, every request is answered with it, as by a
  controller that is failing.

`ControlPlaneThread` runs one on its own loop in a thread, for synchronous
tests driving real processes.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from llmgwctl.catalog import Catalog
from llmgwctl.contracts import AgentReport, Endpoint, EngineAvailability, ReplicaSpec, ReplicaState, ReportedReplica
from llmgwctl.control.api import ControlAPI
from llmgwctl.control.controller import Controller

from .support import FakeClock, LoopThread

REPORT_ROUTE = "/api/v1/agents/{node}/report"
DESIRED_ROUTE = "/api/v1/agents/{node}/desired"
WATCH_ROUTES = ("/api/v1/watch/endpoints", "/api/v1/watch/catalog")
WAKE_ROUTE = "/api/v1/wake"


class ControlPlane:
    def __init__(self, catalogs_dir: str | Path, *, port: int = 0, hold: float | None = None, settle: float = 0.0):
        # A fake clock: nothing here times out on its own (a node missing
        # heartbeats, an idle model) while a test takes its steps. settle 0:
        # settled from the start, so a watch is never held for the settling
        # window and a reported replica is adopted and published at once.
        self.clock = FakeClock()
        self.controller = Controller(str(catalogs_dir), clock=self.clock, settle=settle)
        self.port = port
        self.hold = hold
        self.fail_status: int | None = None
        self.reports: list[dict[str, Any]] = []
        self.report_headers: list[dict[str, str]] = []
        self.rejected: list[str] = []
        self.polls: list[dict[str, str]] = []
        self.wakes: list[str] = []
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = ControlAPI(self.controller).app()
        # Outermost, so it sees every request before the API's own middlewares answer it.
        app.middlewares.insert(0, self._record)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _record(self, request: web.Request, handler):
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else ""
        if route == DESIRED_ROUTE:
            self.polls.append(dict(request.query))
        if self.fail_status:
            return web.Response(status=self.fail_status, text="failing on purpose")
        if self.hold is not None and (route == DESIRED_ROUTE or route in WATCH_ROUTES):
            request = request.clone(rel_url=request.rel_url.update_query(timeout=str(self.hold)))
        response = await handler(request)
        # Read after the handler, which read (and cached) the body of what it accepted.
        if route == REPORT_ROUTE:
            if response.status == 200:
                self.reports.append({**await request.json(), "_node_in_path": request.match_info["node"]})
                self.report_headers.append(dict(request.headers))
            else:
                self.rejected.append(f"{response.status}: {response.text}")
        elif route == WAKE_ROUTE and response.status == 202:
            self.wakes.append((await request.json())["model"])
        return response

    # --- reading what agents sent ---------------------------------------------

    def latest(self) -> dict[str, Any] | None:
        """The last report the controller accepted; AssertionError if it refused one (the protocol drifted)."""
        if self.rejected:
            raise AssertionError(f"the control API refused an agent's report: {self.rejected[0]}")
        return self.reports[-1] if self.reports else None

    def report_count(self) -> int:
        return len(self.reports)

    # --- moving the controller, as its loops would ----------------------------

    def set_desired(self, node: str, specs: Iterable[ReplicaSpec]) -> int:
        """Make `specs` the node's desired list in the real DesiredStore; the version agents will see."""
        self.controller.desired.set(node, specs)
        return self.controller.desired.get(node)[0]

    async def serve(self, catalog: Catalog, node: str, endpoints: Iterable[Endpoint]) -> None:
        """Have the controller publish `catalog` and `endpoints` by the path it publishes them in production.

        The catalog is swapped into its `Live` (the watcher's last step; a
        swap is a watch change only when the catalog differs), `node` reports
        each endpoint as a ready replica through the API, as its agent would,
        and one reconcile pass adopts those replicas and publishes them: the
        watch changes once that pass is over, never halfway through it.
        """
        if catalog != self.controller.live.current:
            self.controller.live.swap(catalog)
        report = report_of(catalog, node, endpoints).to_dict()
        async with aiohttp.ClientSession() as session, \
                session.post(f"{self.url}/api/v1/agents/{node}/report", json=report) as resp:
            if resp.status != 200:
                raise AssertionError(f"the control API refused the report: {resp.status} {await resp.text()}")
        self.adopting_pass()

    def adopting_pass(self) -> None:
        """One reconcile pass that adopts what nodes report, as the pass ending a settling window does.

        A settled controller adopts nothing it did not place on a node
        (reconciler.adoption); these tests make replicas the controller's by
        reporting them, so each such pass runs as if the controller had just
        restarted. The window, 0 s here, is over again by the end of the pass.
        """
        self.controller.reconciler.settled = False
        self.controller.reconciler.reconcile_once()

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.controller.reconciler.endpoints


def report_of(catalog: Catalog, node: str, endpoints: Iterable[Endpoint]) -> AgentReport:
    """The report of a node running each endpoint as a ready replica of the catalog's profile."""
    replicas = []
    for ep in endpoints:
        model = catalog.resolve(ep.model)
        profile = next(p for p in model.profiles if p.name == ep.profile)
        spec = ReplicaSpec.for_profile(ep.replica_id, model, profile, catalog.engines[profile.engine])
        replicas.append(ReportedReplica(id=spec.id, spec_hash=spec.spec_hash, model=spec.model, profile=spec.profile,
                                        engine=spec.engine, gpu_indices=(), state=ReplicaState.READY, url=ep.url,
                                        spec=spec))
    return AgentReport(node=node, boot_id=f"{node}-boot", advertise_host="127.0.0.1",
                       engines={"fake": EngineAvailability(True, "built in")}, replicas=tuple(replicas))


class ControlPlaneThread(LoopThread):
    """A `ControlPlane` on its own event loop in a daemon thread; `call` runs on that loop."""

    def __init__(self, catalogs_dir: str | Path, **options: Any):
        super().__init__()
        # Built on its loop: the controller's events and the API's futures belong there.
        self.plane: ControlPlane = self.call(lambda: ControlPlane(catalogs_dir, **options))
        self.call_async(self.plane.start())

    def __getattr__(self, name: str) -> Any:
        # Reading what was recorded (lists appended on the loop) is safe from here.
        return getattr(self.plane, name)

    # The switches are set on the plane itself (one attribute store each, read by its middleware).
    @property
    def fail_status(self) -> int | None:
        return self.plane.fail_status

    @fail_status.setter
    def fail_status(self, status: int | None) -> None:
        self.plane.fail_status = status

    @property
    def hold(self) -> float | None:
        return self.plane.hold

    @hold.setter
    def hold(self, seconds: float | None) -> None:
        self.plane.hold = seconds

    def set_desired(self, node: str, specs: Iterable[ReplicaSpec]) -> int:
        return self.call(self.plane.set_desired, node, list(specs))

    def serve(self, catalog: Catalog, node: str, endpoints: Iterable[Endpoint]) -> None:
        self.call_async(self.plane.serve(catalog, node, list(endpoints)))

    def stop(self) -> None:
        """Stop serving, as a controller going away; `close` still ends the thread."""
        self.call_async(self.plane.stop())

    def shutdown(self) -> None:
        self.stop()
