"""Who a request is (its API key) and what it cost: counted and logged once per request.

`Accounting.key` is the one place a request's key is looked up; `served`
counts and logs a request an endpoint answered, `refuse` one the router
answered itself. Each request is counted in the router's metrics (pre-bound
children, see `llmgwctl.observability.metrics`), unless turned off written
as one line to the `llmgw.access` log, and, when a `RequestSink` is set (the
controller's request log and history), handed to it as a `RequestRecord`.
"""
from __future__ import annotations

import json
import logging
from time import perf_counter, time

from aiohttp import web

from ..contracts.requestlog import MAX_ERROR, RequestRecord, RequestSink, cut
from ..observability.metrics import RouterMetrics
from . import auth as keyauth
from .balancer import EndpointState
from .call import Call, Refused
from .config import RouterConfig
from .surface import Surface

__all__ = ["Accounting"]

access_log = logging.getLogger("llmgw.access")
# What a 499 (nginx's "client closed request") means in the request log.
_CLIENT_LEFT = "the client went away"


class Accounting:
    """The caller's key, looked up once; each request counted in the metrics and logged once."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, surface: Surface):
        self._config = config
        self._metrics = metrics
        self._surface = surface      # where the API keys are (set_api_keys)
        # Where each request goes once answered (Router.set_request_sink); None: nowhere.
        self.sink: RequestSink | None = None

    def key(self, request: web.Request) -> keyauth.ApiKey | None:
        """The caller's API key; None when the router is open. Refused (401) when keys are on and it sent none of them.

        The one place a request's key is looked up, for every route but
        /healthz (which probes use without one).
        """
        keys = self._surface.keys
        if keys is None:
            return None
        headers = request.headers
        key = keys.lookup(headers.get("Authorization"), headers.get("x-api-key"))
        if key is None:
            raise Refused(keyauth.unauthorized())
        return key

    def served(self, call: Call, state: EndpointState, status: int, first: float, overhead: float,
               usage: tuple[int, int] | None) -> None:
        """Count and log a request an endpoint answered; `first` is when its first byte left (0: at the end)."""
        now = perf_counter()
        elapsed = now - call.t0
        metrics = self._metrics
        # A LoRA adapter's requests count under its own name, as its refusals
        # do (`refuse`): its traffic, latency and tokens apart from its base's.
        # A fallback's call names the model that answered, its endpoint's.
        model = call.model if call.base else state.endpoint.model
        metrics.endpoint(model, state.replica_id).done(
            status, elapsed, (first or now) - call.t0, overhead, usage)
        if call.api_key is not None:
            metrics.key_used(call.api_key.name, status, usage)
        if self._config.access_log and access_log.isEnabledFor(logging.INFO):
            self._log_access(call, status, state.replica_id, elapsed, overhead, usage)
        if self.sink is not None:
            self._record(call, status, state.replica_id, elapsed, (first or now) - call.t0, usage,
                         None if status < 400 else _CLIENT_LEFT if status == 499 else f"the engine answered {status}")

    def refuse(self, call: Call, resp: web.Response) -> web.Response:
        """Count and log a request answered without an endpoint (4xx, 5xx of the router's own)."""
        metrics = self._metrics
        metrics.unrouted(call.model, resp.status)
        if call.api_key is not None:
            metrics.key_used(call.api_key.name, resp.status, None)
        if self._config.access_log and access_log.isEnabledFor(logging.INFO):
            self._log_access(call, resp.status, "", perf_counter() - call.t0)
        if self.sink is not None:
            self._record(call, resp.status, "", perf_counter() - call.t0, None, None, _reason(resp))
        return resp

    def _record(self, call: Call, status: int, replica: str, elapsed: float, ttft: float | None,
                usage: tuple[int, int] | None, error: str | None) -> None:
        assert self.sink is not None
        tokens_in, tokens_out = usage if usage is not None else (None, None)
        # The last replica of a stream cut and continued elsewhere is the one that finished it.
        if call.continued:
            replica = call.continued[-1][1]
        self.sink.record(RequestRecord(
            at=time(), id=call.rid, key=call.api_key.name if call.api_key is not None else None,
            asked=cut(call.asked), model=call.model, status=status, path=cut(call.request.path),
            stream=call.stream, ttft=ttft, duration=elapsed, tokens_in=tokens_in, tokens_out=tokens_out,
            replica=replica, error=error))

    def _log_access(self, call: Call, status: int, endpoint: str, seconds: float,
                    overhead: float | None = None, usage: tuple[int, int] | None = None) -> None:
        # The key's name, never the key; the client address, never a body.
        # `endpoint` is the replica id: in a log line the exact replica is the
        # point (metrics label by slot instead, see observability.metrics).
        request, model = call.request, call.model
        name = call.api_key.name if call.api_key is not None else "-"
        tokens_in, tokens_out = usage if usage is not None else (None, None)
        # A cut stream's hand-overs, only when there were any: FROM>TO@TOKENS sent at the cut.
        continued = ",".join(f"{a}>{b}@{n}" for a, b, n in call.continued)
        # The name asked by, when it was an alias of `model` (the served name); a
        # catalog name, never a client's unresolved string.
        asked = call.echo_as or model
        # The model asked for, only when a fallback answered it (`model` is the one that did).
        fallback = call.fallback_from
        access_log.info("%s %s %s %d model=%s%s endpoint=%s key=%s id=%s tokens=%s/%s attempts=%d %.1fms%s%s",
                        request.remote, request.method, request.path, status, model or "-",
                        f" asked={asked}" if asked != model else "", endpoint or "-", name,
                        call.rid, "-" if tokens_in is None else tokens_in, "-" if tokens_out is None else tokens_out,
                        call.attempts, seconds * 1e3, f" continued={continued}" if continued else "",
                        f" fallback_from={fallback}" if fallback else "",
                        extra={"event": "access", "client": request.remote, "method": request.method,
                               "path": request.path, "status": status, "model": model, "model_asked": asked,
                               "endpoint": endpoint,
                               "key": name, "request_id": call.rid, "tokens_in": tokens_in,
                               "tokens_out": tokens_out, "attempts": call.attempts,
                               "duration_ms": round(seconds * 1e3, 3),
                               "overhead_ms": None if overhead is None else round(overhead * 1e3, 3),
                               **({"continued": [{"from": a, "to": b, "tokens": n} for a, b, n in call.continued]}
                                  if continued else {}),
                               **({"fallback_from": fallback} if fallback else {})})


def _reason(resp: web.Response) -> str | None:
    """The message of the router's own refusal (OpenAI-shaped JSON), for the request log; None for a 2xx/3xx."""
    if resp.status < 400:
        return None
    if resp.status == 499:
        return _CLIENT_LEFT
    body = resp.body
    if isinstance(body, bytes) and body[:1] == b"{":
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if isinstance(message, str):
            return cut(message, MAX_ERROR)
    return f"HTTP {resp.status}"
