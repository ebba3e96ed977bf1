"""The router: the OpenAI-compatible data plane clients talk to.

Owns resolving a request's model (name or alias) against the current catalog,
choosing an endpoint (priority tiers, load per weight, power of two choices,
ejection after connection failures), retrying on another replica what failed
before its first byte, proxying with streams passed through as
bytes, polling engines' /metrics for load, holding requests for a cold model,
and reporting usage. Its modules:

    config     RouterConfig: every knob and its default, once
    balancer   per-endpoint state and the pick
    poller     /metrics polling into the balancer
    coldstart  the bounded wait for a cold model, and the Waker protocol
    errors     OpenAI-shaped error responses
    auth       optional API keys: 401 / 403 / 429, the key file and its watcher
    limits     input limits only the router checks (JSON depth, paths, large bodies held); the shared ones are in llmgwctl.httpserver
    routes     the route table: the APIs proxied, and the routes a catalog's engines add
    jsonbody   what the router reads out of a body, parsed off the loop when costly; the alias rewrite in place
    server     Router (set_endpoints, set_catalog, usage_snapshot): builds the parts below, its aiohttp app
    surface    what the control plane tells the router: endpoints, catalog, model states, API keys
    request    the request path: target, key and rate, then its steps below
    bodies     a request's body read within its size, time and budget, inflated
    intake     the body parsed once, its model resolved (aliases, adapters), key and route checked
    reroute    a request switched to a fallback model, its body renamed for the model served
    dispatch   endpoints picked and tried in turn within the request's attempts; the pool to engines
    fallback   which fallback model answers when the model asked for has no replica that can
    retry      which failed attempts go to another replica before the first byte, and each request's budget
    answer     the answer path: whole or streamed, slow readers, a stream opened early for a cold start
    continuation  a cut chat stream resumed on another replica and spliced onto the client's (opt-in per model)
    accounting the caller's key; each request counted and logged once
    info       /health, /healthz, /readyz, /metrics, /v1/models, the 404
    call       what those parts pass each other: View, Call, Refused
    usage      the token counts read off an answer's bytes, for metrics and the access log
    upstream   the keep-alive HTTP/1.1 client that carries requests to engines
    static     the static endpoint file (`llmgwctl router --endpoints FILE`)
    watch      following a controller's watch stream (`llmgwctl router --controller URL`)
    standalone running a router as its own process

It must not know about placement, agents or the reconciler: it is told the
endpoints and the catalog, and reports usage, through the narrow surfaces in
`server.Router`; the control plane imports it, never the other way round.
What it is told (`Endpoint`, `LoadReading`) and reports (the usage snapshot)
are contracts, in `llmgwctl.contracts`.
"""
from .coldstart import Waker
from .config import RouterConfig
from .server import Router, start

__all__ = ["Router", "RouterConfig", "Waker", "start"]
