"""A request's model, resolved from its body before the first attempt: what the request asks, and of whom.

`Intake.resolve` parses the body once (off the loop when costly,
`jsonbody`) and resolves its model against the catalog taken once for the
request (`call.View`): a name or an alias, or a LoRA adapter picked among
its base's replicas. It checks the caller's key and the route against that
model, pins a Responses request naming a stored response to the replica
that stored it (`affinity`), takes the fallback that answers for a model
with no replica that can (`reroute.Rerouting.at_start`), builds the model's
routing policy's chooser (`policies`), and renames the body for the model
served, an alias's echoed back in the answer (echo.py). It fills the `Call`
and returns the body to forward; every refusal is a `call.Refused`. It must
not know about endpoints beyond what the rerouting and the affinity ask.
"""
from __future__ import annotations

from . import auth as keyauth
from . import errors, jsonbody
from .affinity import Affinity
from .call import Call, Refused, known, usable_names
from .config import RouterConfig
from .policies import Policies
from .reroute import Rerouting, renamed

__all__ = ["Intake"]


class Intake:
    """The model of each request, resolved from its body into its `Call` (`resolve`)."""

    def __init__(self, config: RouterConfig, *, parser: jsonbody.OffLoop, policies: Policies, affinity: Affinity,
                 rerouting: Rerouting):
        self._config = config
        self._parser = parser
        self._policies = policies
        self._affinity = affinity   # which replica stored a response a request names
        self._rerouting = rerouting  # the fallback of a model with no replica that can answer (reroute.py)

    async def resolve(self, call: Call, body: bytes) -> bytes:
        """Parse the body and resolve its model into `call`; return the body to forward."""
        facts = await self._parse(call, body)
        name = facts.model
        if type(name) is not str or not name:
            raise Refused(errors.missing_model())
        if len(name) > errors.MAX_NAME_CHARS:
            # Before any lookup, key pattern or "did you mean": no name is that long.
            raise Refused(errors.name_too_long(name, facts.model_chars))
        view = call.view
        call.asked = name
        model = view.catalog.resolve(name)
        adapter = None
        if model is None:
            ref = view.catalog.adapter(name)
            if ref is not None:
                # A LoRA adapter: picked under its own name among the base's
                # replicas that hold it (balancer), under the base's route and policy.
                adapter, model = ref.adapter, ref.base
                call.base = model.name
        served = adapter.name if adapter is not None else model.name if model is not None else ""
        call.model = served
        if call.api_key is not None and not keyauth.allows(call.api_key, name, adapter or model):
            raise Refused(keyauth.forbidden(name))
        if model is None:
            raise Refused(errors.unknown_model(name, usable_names(view.catalog, call.api_key)))
        route = call.route
        if not view.routes.allows(route, model.name):
            raise Refused(errors.no_such_route(call.request.method, route.path, model.name))
        call.stream = route.streams and facts.stream
        previous = facts.doc.get("previous_response_id") if route.binds else None
        if previous is not None:
            if type(previous) is not str:
                raise Refused(errors.response(400, "'previous_response_id' must be a string, a response's id",
                                              "invalid_request_error", "invalid_previous_response_id"))
            # Only the replica that stored it can continue it: no policy picks, and
            # no fallback model, which never saw the response it names.
            call.response_id = previous
            call.pinned = self._affinity.endpoint(call, previous, model.name)
        elif adapter is None:
            # An adapter's request has no fallback: another model lacks the adapter.
            chain = view.fallbacks.get(model.name)
            if chain:
                model = self._rerouting.at_start(call, model, chain)
                served = model.name
        policy = view.routing.get(model.name) if call.pinned is None else None
        if policy is not None:
            # Parsed on the loop, the prompt is read only now, when a policy wants it.
            reader = known(facts.prompt) if facts.off_loop else route.prompt
            # Under the served name: an adapter's KV cache is its own, not its base's.
            call.chooser = self._policies.chooser(policy, served, facts.doc, call.request.headers, prompt=reader)
        if name != served:
            body = renamed(body, facts, route.model_key, served)
            if not call.fallback_from:
                # An alias: echoed back in the answer (echo.py). A fallback's
                # answer names the model that gave it, as its headers do.
                call.echo_as = name
        return body

    async def _parse(self, call: Call, body: bytes) -> jsonbody.Facts:
        """The body's facts, parsed on the loop when cheap for certain, else off it (see jsonbody)."""
        route, depth = call.route, self._config.max_json_depth
        try:
            if jsonbody.heavy(body):
                return await self._parser.parse(body, route.model_key, route.prompt, depth)
            return jsonbody.parse(body, route.model_key, depth)
        except jsonbody.BodyRefused as exc:
            raise Refused(errors.response(400, str(exc), "invalid_request_error", exc.code)) from None
        except jsonbody.WorkerBusy:
            raise Refused(errors.response(
                503, "the router is parsing as many large request bodies as it may at once; retry shortly",
                "service_unavailable", "too_many_large_bodies",
                headers={"Retry-After": str(errors.RETRY_LARGE_BODIES)})) from None
