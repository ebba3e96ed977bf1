"""What the router's parts pass each other: the catalog as the hot path sees it, one request on its way, a refusal.

`View` is built once per catalog (`set_catalog`); a `Call` is one proxied
request, taken at arrival with the view of that moment; `Refused` is how any
step of the request path answers the request itself. The parts that meet
them -- the request path (`request`, and its steps `bodies`, `intake`,
`reroute`, `dispatch`), the answer path (`answer`), accounting
(`accounting`), the info routes (`info`) -- import them from here, so none
imports another for a type.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from ..catalog import Catalog
from ..catalog.fallbacks import chains
from . import auth as keyauth
from . import headers as reqheaders
from . import routes as routing
from .balancer import Chooser, EndpointState
from .conventions import RID
from .policies import DEFAULT_POLICY, LEAST_LOAD

__all__ = ["Call", "Refused", "View", "known", "named", "usable_names"]


class View:
    """The per-catalog facts the hot path needs, built once per `set_catalog`."""

    __slots__ = ("catalog", "version", "top_profile", "routing", "routes", "continuation", "fallbacks")

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.version = catalog.version
        # A model whose best profile has no ready endpoint is cold, even when a
        # fallback profile serves it meanwhile.
        self.top_profile = {m.name: m.ranked()[0].name for m in catalog.models if m.profiles}
        # Only models whose policy is not least-load: the rest pay one failed lookup.
        self.routing = {m.name: m.routing or DEFAULT_POLICY for m in catalog.models
                        if (m.routing or DEFAULT_POLICY) != LEAST_LOAD}
        # The routes the catalog's engines add (routes.py), and who may use them.
        self.routes = routing.View(catalog)
        # Hand-overs a cut stream may make, for the models that turned continuation on (continuation.py).
        self.continuation = {m.name: m.continuation for m in catalog.models if m.continuation}
        # Each model's whole chain of fallbacks, for the models that name any (fallback.py).
        self.fallbacks = chains(catalog)


class Call:
    """One proxied request on its way through the router: what each step after arrival needs.

    Filled in as the request advances -- the caller's key once checked, the
    model once resolved -- and owned by that request alone. It is the one
    object of the router's own a request allocates.
    """

    __slots__ = ("request", "route", "t0", "api_key", "model", "view", "stream", "waited", "rid", "fwd", "early",
                 "chooser", "held", "body", "continued", "attempts", "fallback_from", "pinned", "response_id",
                 "base", "asked", "echo_as")

    def __init__(self, request: web.Request, route: routing.Route, t0: float, view: View):
        self.request = request
        self.route = route                      # the API it is for (routes.py)
        self.t0 = t0                            # arrival, on perf_counter
        # Taken once, at arrival: a catalog swap from here on is invisible to this request.
        self.view = view
        self.api_key: keyauth.ApiKey | None = None     # None: not checked yet, or the router is open
        self.model = ""                         # the canonical name once resolved; "" is logged as "-"
        self.asked = ""                         # the name the body gave (an alias, say), for the request log
        # The alias the client named the model by, echoed in the answer (echo.py); "": none to echo.
        self.echo_as = ""
        self.stream = False                     # the body asked for a stream ("stream": true)
        # Seconds spent waiting on others -- a cold wait, failed attempts, the
        # answering engine -- so the router's own time (its overhead) is the
        # time since arrival less this.
        self.waited = 0.0
        # The request id (the client's if valid, else ours) and the header lines
        # the engine gets (see headers.py): taken at arrival.
        self.rid, self.fwd = reqheaders.take(request.headers)
        request[RID] = self.rid
        # The event stream opened early to keep a client waiting for a cold
        # start company (see conventions.held_for_cold_start); None until then.
        self.early: web.StreamResponse | None = None
        # The model's routing policy for this request (router.policies); None: least-load.
        self.chooser: Chooser | None = None
        # Bytes of its body charged to the large-body budget (limits.BodyBudget), given back at its end.
        self.held = 0
        # The body as forwarded, once read and resolved: what a cut stream's continuation is built from.
        self.body = b""
        # A cut stream's hand-overs (continuation.py): (from replica, to replica, tokens sent at the cut).
        self.continued: tuple[tuple[str, str, int], ...] = ()
        # Endpoints tried so far before its first byte (retry.py); 0: none yet.
        self.attempts = 0
        # The model the client asked for when a fallback answers instead (fallback.py); "" when it answers itself.
        self.fallback_from = ""
        # The one endpoint this request may go to: the replica that stored the
        # response it names (affinity.py); None: any the balancer picks.
        self.pinned: EndpointState | None = None
        # The stored response it names (`previous_response_id`, or the path's id); None: none.
        self.response_id: str | None = None
        # For a LoRA adapter's request: its base model's name (`model` is then
        # the adapter's, which its endpoints are picked under); "" otherwise.
        self.base = ""


class Refused(Exception):
    """The router answers this request itself (a 4xx, or a 5xx of its own), with `response`.

    Raised anywhere on the request path; `RequestPath._run` catches it and counts
    and logs the refusal once.
    """

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response


def known(prompt: str | None) -> Callable[[Mapping[str, Any]], str | None]:
    """A prompt reader that returns the prompt the body's facts already hold."""
    return lambda doc: prompt


def usable_names(catalog: Catalog, api_key: keyauth.ApiKey | None) -> list[str]:
    """The names and aliases a 404 may suggest: all of them on an open router, else those `api_key` may use.

    A key limited to some models must not learn the rest from a "did you mean".
    """
    names = catalog.names()
    if api_key is None:
        return list(names)
    return [n for n in names if keyauth.allows(api_key, n, named(catalog, n))]


def named(catalog: Catalog, name: str) -> Any | None:
    """What `name` names for a key's patterns: a model, or an adapter (a model of its own to keys), or None."""
    model = catalog.resolve(name)
    if model is not None:
        return model
    ref = catalog.adapter(name)
    return ref.adapter if ref is not None else None
