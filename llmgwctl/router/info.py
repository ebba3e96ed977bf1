"""The router's own routes, answered without an engine: health, readiness, metrics, the model list, 404.

`/health` (liveness), `/healthz` (a summary), `/readyz` (readiness, with
why not), `/metrics` (Prometheus), `/v1/models` and `/v1/models/{id}`
(OpenAI's list and retrieve, only what the caller's key may use, each
model with its aliases, whether it is loaded and its context length), and
the 404 (or 405, or 400 for a dot segment) of every other path.
"""
from __future__ import annotations

import json

from aiohttp import web

from ..catalog import Model
from ..observability.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from . import auth as keyauth
from . import errors
from .accounting import Accounting
from .balancer import Balancer
from .call import Refused, View, usable_names
from .config import RouterConfig
from .conventions import method_not_allowed
from .limits import PathError, check_target
from .modelinfo import ModelInfo
from .surface import Surface

__all__ = ["InfoRoutes"]


class InfoRoutes:
    """The handlers of the routes the router answers itself."""

    def __init__(self, config: RouterConfig, *, balancer: Balancer, metrics: RouterMetrics, surface: Surface,
                 accounting: Accounting, modelinfo: ModelInfo):
        self._config = config
        self._modelinfo = modelinfo
        self._balancer = balancer
        self._metrics = metrics
        self._surface = surface
        self._accounting = accounting
        # The open router's model list, rebuilt when the catalog or the endpoints change.
        self._models_cache: tuple[object, bytes] = (None, b"")

    async def healthz(self, request: web.Request) -> web.Response:
        view = self._surface.view
        return web.json_response({"status": "ok", "catalog_version": view.version,
                                  "models": len(view.catalog), "endpoints": len(self._balancer.states())})

    async def health(self, request: web.Request) -> web.Response:
        """Liveness, as vLLM's and llama-swap's /health: 200 while the process answers, whatever it routes.

        A load balancer or an orchestrator restarts a process that fails this,
        so it must not fail for what a restart cannot fix (no replica yet).
        """
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness (Kubernetes' /readyz): 200 once the router can route, else 503 with why.

        Ready means it was told a catalog holding a model and was told an
        endpoint list (the first push or watch answer), so a request gets an
        answer from the fleet's state rather than a 404 from an empty router.
        It does *not* need a ready endpoint: with scale to zero, a router with
        none is how models get woken, and taking it out of the load balancer
        would keep them asleep for good.
        """
        surface = self._surface
        view = surface.view
        problems = []
        if not len(view.catalog):
            problems.append("no catalog with a model in it yet")
        if not surface.told_endpoints:
            problems.append("no endpoint list received yet")
        body: dict[str, object] = {"status": "ready" if not problems else "not ready",
                                   "catalog_version": view.version,
                                   "models": len(view.catalog), "endpoints": len(self._balancer.states())}
        if problems:
            body["problems"] = problems
        return web.json_response(body, status=503 if problems else 200)

    async def not_found(self, request: web.Request) -> web.Response:
        try:
            check_target(request.raw_path, "/")
        except PathError as exc:
            # Refused as on /v1/: a dot segment there is a probe, not a typo.
            return errors.response(400, str(exc), "invalid_request_error", "invalid_path")
        wrong_method = method_not_allowed(request, cors=bool(self._config.cors_origins))
        if wrong_method is not None:
            return wrong_method
        return errors.not_found(f"{request.method} {request.path}")

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            self._accounting.key(request)
        except Refused as refused:
            return refused.response
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        view = self._surface.view
        headers = {"x-llmgw-catalog-version": view.version}
        try:
            api_key = self._accounting.key(request)
        except Refused as refused:
            return refused.response
        if api_key is not None:
            # Only what this key may use: the list must not reveal the rest.
            return web.Response(body=self._models_body(view, api_key), content_type="application/json",
                                headers=headers)
        surface = self._surface
        cache_key = (view, self._balancer.generation, self._modelinfo.generation, surface.starting,
                     tuple(surface.unplaceable))
        if self._models_cache[0] != cache_key:
            self._models_cache = (cache_key, self._models_body(view))
        return web.Response(body=self._models_cache[1], content_type="application/json", headers=headers)

    async def model(self, request: web.Request) -> web.Response:
        """One entry of the list by its id (a name or an alias): OpenAI's "retrieve model"."""
        view = self._surface.view
        name = request.match_info["name"]
        try:
            api_key = self._accounting.key(request)
        except Refused as refused:
            return refused.response
        model = view.catalog.resolve(name)
        # As OpenAI's retrieve: a model outside the key's patterns is the same
        # 404 as one that does not exist, so nothing tells the two apart.
        if model is None or (api_key is not None and not keyauth.allows(api_key, name, model)):
            return errors.unknown_model(name, usable_names(view.catalog, api_key),
                                        or_not_permitted=api_key is not None)
        entry = self._model_entry(model, name)
        return web.Response(body=json.dumps(entry).encode(), content_type="application/json",
                            headers={"x-llmgw-catalog-version": view.version})

    def _models_body(self, view: View, api_key: keyauth.ApiKey | None = None) -> bytes:
        data = []
        for m in view.catalog.models:
            if api_key is not None and not keyauth.allows(api_key, m.name, m):
                continue
            data.append(self._model_entry(m, m.name))
            data.extend(self._model_entry(m, alias) for alias in m.aliases)
        return json.dumps({"object": "list", "data": data}).encode()

    def _model_entry(self, model: Model, listed_as: str) -> dict[str, object]:
        """A model (or one of its aliases) in OpenAI's model shape, with what clients read beside it.

        OpenAI's four fields; the model's `aliases`; `status` (see `_status`);
        its `context_length` as its engines said it (modelinfo.py; null until
        one did), also as `max_model_len`, the name vLLM's clients read;
        `parent`, the base model of an adapter (null: a base model, which
        every model is until adapters are); and llmgw's extension field.
        """
        ready = self._balancer.ready_count(model.name)
        extra: dict[str, object]
        if listed_as == model.name:
            extra = {"ready_replicas": ready, "aliases": list(model.aliases),
                     "profiles": [p.name for p in model.ranked()]}
        else:
            extra = {"ready_replicas": ready, "alias_of": model.name}
        context = self._modelinfo.context_length(model.name)
        if context is None:
            context = model.context_length      # the catalog's, until an engine said one
        return {"id": listed_as, "object": "model", "created": 0, "owned_by": "llmgw",
                "aliases": list(model.aliases), "status": self._status(model.name, ready),
                "context_length": context, "max_model_len": context, "parent": None, "llmgw": extra}

    def _status(self, name: str, ready: int) -> str:
        """`loaded`: a replica is ready; `loading`: the controller says one is starting; `unplaceable`: it
        says none fits now; `unloaded`: none ready and none starting (scaled to zero, or not placed yet),
        so a request wakes it and waits."""
        if ready:
            return "loaded"
        surface = self._surface
        if name in surface.unplaceable:
            return "unplaceable"
        return "loading" if name in surface.starting else "unloaded"
