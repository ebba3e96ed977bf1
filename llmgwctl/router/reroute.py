"""Rerouting: a request moved from the model it resolved to a fallback model, and its body renamed to match.

Asked twice at most per request (fallback.py says when a fallback is taken):

- `at_start`, as the request's model is resolved (`intake.Intake`), before
  any endpoint is picked: the model, or the fallback that answers for it;
- `after_refusals`, when every endpoint of the model refused the request's
  connection (`dispatch.Dispatch.forward`): the fallback's body and endpoint,
  picked by the fallback's own policy, or None when none can take it.

Either way `_switch` marks the call (`fallback_from`, `model`), counts the
fallback, and clears `echo_as`: a fallback's answer names the model that gave
it, as its headers do, even for a request that came by alias. `renamed` is
the body naming another model: an alias's served name, or a fallback's. It
must not know about endpoints beyond the balancer's pick, nor the HTTP
request beyond the `Call`.
"""
from __future__ import annotations

import json

from ..catalog import Model
from ..observability.metrics import RouterMetrics
from . import errors, jsonbody
from .balancer import Balancer, EndpointState
from .call import Call, Refused
from .coldstart import ColdStart
from .fallback import DOWN, Choice, Fallbacks
from .policies import Policies
from .surface import Surface

__all__ = ["Rerouting", "renamed"]


class Rerouting:
    """A request's switch to a fallback model: as its model is resolved (`at_start`), or after refusals."""

    def __init__(self, *, balancer: Balancer, policies: Policies, cold: ColdStart, metrics: RouterMetrics,
                 surface: Surface):
        self._balancer = balancer
        self._policies = policies   # the fallback's own routing policy, after refusals
        self._cold = cold           # woken for a model that is down while its fallback answers
        self._metrics = metrics
        self._surface = surface     # what the controller says cannot be placed now
        # Which model answers a request whose own has no replica that can (fallback.py).
        self._fallbacks = Fallbacks(balancer)

    def at_start(self, call: Call, model: Model, chain: tuple[str, ...]) -> Model:
        """The model that answers `call`: `model`, or the fallback taken when it has no replica that can (fallback.py).

        Asked after the key and the route were checked against `model`, so a
        request its key or route could not send to `model` gets `model`'s refusal,
        never a fallback's answer.
        """
        choice = self._switch(call, model, chain)
        if choice is None:
            return model
        if choice.reason == DOWN:
            # Woken all the same, as a request waiting for it would: the
            # fallback answers until the model's own replica is ready.
            self._cold.demand(model.name)
        return choice.model

    def after_refusals(self, call: Call, body: bytes) -> tuple[bytes, EndpointState] | None:
        """`call` moved to a fallback once every endpoint of its model refused the connection: the body
        renamed for it and its endpoint; None when the model has no fallback that can take it.

        The model's policy chooser was built for the model's endpoints: the
        fallback's is built anew, from the body parsed again (it passed once),
        so its pick follows its own policy; least-load's for a body too large
        to parse again on the loop.
        """
        view = call.view
        chain = view.fallbacks.get(call.model)
        model = view.catalog.resolve(call.model)
        if not chain or model is None:
            return None
        choice = self._switch(call, model, chain)
        if choice is None:
            return None
        name = choice.model.name
        body = call.body = renamed(body, None, call.route.model_key, name)
        policy = view.routing.get(name)
        call.chooser = None if policy is None or jsonbody.heavy(body) else self._policies.chooser(
            policy, name, jsonbody.parse(body, call.route.model_key, 0).doc, call.request.headers,
            prompt=call.route.prompt)
        state = self._balancer.pick(name, (), call.chooser)
        # choose() took a fallback with a usable endpoint, and nothing ran since: there is one.
        assert state is not None
        return body, state

    def _switch(self, call: Call, model: Model, chain: tuple[str, ...]) -> Choice | None:
        """The fallback of `model` that `call` goes to, counted and marked on the call; None: `model` keeps it."""
        unplaceable = self._surface.unplaceable
        choice = self._fallbacks.choose(call, model, chain, bool(unplaceable) and model.name in unplaceable)
        if choice is None:
            return None
        self._metrics.fallbacks.labels(model.name, choice.model.name, choice.reason).inc()
        call.fallback_from = model.name
        call.model = choice.model.name
        # A fallback's answer names the model that gave it, as its headers do,
        # even when the request came by alias and was already set to echo it.
        call.echo_as = ""
        return choice


def renamed(body: bytes, facts: jsonbody.Facts | None, key: str, name: str) -> bytes:
    """`body` naming the model `name` instead of the alias it was sent with: only the model's value changes.

    `facts`: what parsing the body found, which saves a scan; None for a
    body already forwarded once (a fallback after refusals, `Rerouting.after_refusals`).
    """
    lone = facts.lone_surrogate if facts is not None else None
    if lone is None:
        lone = jsonbody.lone_surrogate(body)
    if lone:
        # A lone surrogate ("\ud800"): JSON's escapes can spell it, UTF-8
        # cannot, and no engine could read it either. Refused by alias as
        # ever (a rewrite once re-encoded the body, which failed on it).
        raise Refused(errors.response(
            400, "the request body holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
            "which is not text", "invalid_request_error", "invalid_json"))
    span = (facts.span if facts is not None else None) or jsonbody.model_span(body, key)
    if span is not None:
        return jsonbody.with_model(body, span, name)
    # Not UTF-8 (JSON may be UTF-16 or 32): re-encoded whole, as UTF-8.
    doc = json.loads(body)
    doc[key] = name
    try:
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        raise Refused(errors.response(
            400, "the request body holds a lone UTF-16 surrogate, which is not text", "invalid_request_error",
            "invalid_json")) from None
