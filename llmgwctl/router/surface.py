"""What the control plane tells the router, kept where the request path reads it.

`Surface` holds the state the control plane pushes -- the endpoints (into the
balancer), the catalog (as a `call.View`), the models that cannot be placed
now, the API keys -- each replaced once per change, never pulled per request.
`Router` exposes its methods under the same names (`set_endpoints`,
`change_endpoints`, `set_model_states`, `set_catalog`, `set_api_keys`); the
request path and the info routes read `view`, `keys`, `unplaceable`, `starting`
and `told_endpoints` from here.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping

from ..catalog import Catalog
from ..contracts import Endpoint, ModelCondition, ModelState
from ..observability.metrics import RouterMetrics
from . import auth as keyauth
from .balancer import Balancer
from .call import View
from .coldstart import ColdStart
from .upstream import BadEndpointURL, parse_target

__all__ = ["Surface"]

log = logging.getLogger("llmgw.router")


@functools.lru_cache(maxsize=65536)
def _url_problem(url: str) -> str | None:
    """Why no request could be sent to `url`, or None; remembered per URL.

    Every push of the list checks every endpoint, and parsing each URL again
    at every push is a large share of a publishing pass at fleet scale (see
    bench/README.md). 65,536 URLs: well past a fleet's endpoints, a few MB at most.
    """
    try:
        parse_target(url)
    except BadEndpointURL as exc:
        return str(exc)
    return None


class Surface:
    """The control plane's side of the router: endpoints, catalog, model states, API keys."""

    def __init__(self, catalog: Catalog, *, balancer: Balancer, metrics: RouterMetrics, cold: ColdStart,
                 limiter: keyauth.Limiter, resync: Callable[[], None]):
        self._balancer = balancer
        self._metrics = metrics
        self._cold = cold
        self._limiter = limiter
        # The poller's, told when the list changes so it scrapes the new endpoints.
        self._resync = resync
        self.view = View(catalog)
        self.keys: keyauth.ApiKeys | None = None
        self.bad_urls: dict[str, str] = {}      # replica id -> the url it was left out for, logged once
        # Models the controller cannot place now, by name: a request finding no
        # endpoint for one is answered at once (set_model_states).
        self.unplaceable: dict[str, ModelState] = {}
        # ... and those it says have a replica starting: /v1/models shows them loading.
        self.starting: frozenset[str] = frozenset()
        self.told_endpoints = False         # set_endpoints was called once: /readyz

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the whole list of ready endpoints. Call on the event loop, once per change.

        An endpoint whose URL no request could be sent to is left out, with an
        error logged once: it is a configuration error, and sending to it would
        look like an engine down and eject it again and again.
        """
        balancer = self._balancer
        refused: dict[str, str] = {}
        usable = [ep for ep in endpoints if self._usable(ep, refused, self.bad_urls.get(ep.replica_id))]
        self.bad_urls = refused
        self.told_endpoints = True
        gained, added, removed = balancer.change_endpoints(balancer.changes_to(usable))
        self._metrics.change_endpoints(added, removed)
        self._cold.endpoints_changed(gained)
        self._resync()

    def change_endpoints(self, endpoints: tuple[Endpoint, ...], changed: Mapping[str, Endpoint | None]) -> None:
        """The list changed by `changed` (replica id -> its new Endpoint, or None: it left); `endpoints` is the whole new list.

        What the in-process controller calls (contracts.RouterSink): a
        push costs the endpoints that changed, not every endpoint listed. The
        same as `set_endpoints(endpoints)`; if the balancer's count disagrees
        with the list afterwards (a push this router missed), it takes the
        whole list instead.
        """
        balancer = self._balancer
        refused = self.bad_urls
        changes: dict[str, Endpoint | None] = {}
        for rid, ep in changed.items():
            logged = refused.pop(rid, None)
            changes[rid] = ep if ep is None or self._usable(ep, refused, logged) else None
        self.told_endpoints = True
        gained, added, removed = balancer.change_endpoints(changes)
        if balancer.count() != len(endpoints) - len(refused):
            log.warning("the router's endpoints drifted from the controller's list; taking the whole list")
            self.set_endpoints(endpoints)
            return
        self._metrics.change_endpoints(added, removed)
        self._cold.endpoints_changed(gained)
        if added or removed:
            self._resync()

    def _usable(self, ep: Endpoint, refused: dict[str, str], logged: str | None) -> bool:
        """Whether a request could be sent to `ep`'s URL; if not, it goes into `refused`, logged
        unless `logged` (the URL it was last refused for) is this one."""
        problem = _url_problem(ep.url)
        if problem is None:
            return True
        refused[ep.replica_id] = ep.url
        if logged != ep.url:
            log.error("endpoint %s of %r left out of routing: %s", ep.replica_id, ep.model, problem,
                      extra={"event": "endpoint-url-invalid", "endpoint": ep.replica_id})
        return False

    def set_model_states(self, states: Iterable[ModelState]) -> None:
        """Replace what the controller says about models without a ready replica. Call on the event loop, once per change.

        Only `unplaceable` changes what a request gets (a 503 at once, with the
        reason); `starting`, like no state at all, means a request waits.
        Requests already waiting re-check, so one held for a model that turns
        out unplaceable is answered now, not at the cold timeout.
        """
        states = list(states)
        new = {s.name: s for s in states if s.state is ModelCondition.UNPLACEABLE}
        self.starting = frozenset(s.name for s in states if s.state is ModelCondition.STARTING)
        old = self.unplaceable
        self.unplaceable = new
        self._cold.nudge({name for name in new.keys() | old.keys() if new.get(name) != old.get(name)})

    def set_catalog(self, catalog: Catalog) -> None:
        """Make `catalog` the one new requests resolve against; requests already running keep theirs."""
        if catalog.version != self.view.version:
            self.view = View(catalog)

    def set_api_keys(self, keys: keyauth.ApiKeys | None) -> None:
        """Require one of `keys` on every request from now on (None: no keys, the router is open)."""
        self.keys = keys
        if keys is not None:
            self._limiter.retain(keys.names())
            self._metrics.retain_keys(keys.names())
