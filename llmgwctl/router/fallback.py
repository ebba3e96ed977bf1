"""Fallback models: which model answers a request whose own model has no replica that can.

A model's chain is its catalog `fallbacks`, each followed by its own, in order
(llmgwctl.catalog.fallbacks.chains, built once per catalog into the `View`).
`Fallbacks.choose` is asked for a request for a model with a chain as the
request arrives, before its endpoint is picked, and judges by what the router
knows then -- the endpoints listed, their ejections and their room (the
balancer's own pick rules), and what the controller said about placement:

    the model's own state      why            a fallback taken when it has
    an endpoint with room      --             (none: the model answers)
    every usable one full      saturated      room: a request there starts now, where the
                                              model's would queue behind a full batch
    none usable, unplaceable   unplaceable    any usable endpoint, room first
    none usable                down           any usable endpoint, room first (the
                                              model is woken all the same, by the caller)

"Full" is the balancer's: the count of requests its engine was last seen
queueing at, or its KV cache at 0.95. That bound is the one the pick already
spills across priority tiers by, so a model falls back to another model
exactly when it would otherwise queue at a replica that is known to be full,
and never on a guess (an engine that has never been seen full has room).

It is asked once more, at most, when every endpoint of the model refused the
request's connection (the request ran nowhere, and the model turns out down):
the request goes to the fallback instead of waiting for the model's engines
to come back (`dispatch.Dispatch.forward`). A request a fallback took never falls
back again.

When no fallback can take it, the request stays with its model and gets what
it always got there: a 503 with the placement's reason, a cold-start wait, a
place in a full engine's queue. The first fallback in order that fits wins;
room beats order only between a full fallback and one with room when the
model is down.

A fallback the caller's API key may not use is skipped, as is one whose
engines do not serve the request's route: a fallback never widens what a key
reaches or what a route reaches. It must not know about the HTTP request
beyond the `Call`, nor about the controller.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..catalog import Model
from . import auth as keyauth
from .balancer import Balancer
from .call import Call

__all__ = ["DOWN", "SATURATED", "UNPLACEABLE", "Choice", "Fallbacks"]

# Why a request fell back: the `reason` label of llmgw_router_fallbacks_total.
UNPLACEABLE = "unplaceable"
DOWN = "down"
SATURATED = "saturated"


@dataclass(frozen=True, slots=True)
class Choice:
    """The model a request falls back to, and why its own could not take it."""

    model: Model
    reason: str


class Fallbacks:
    """The choice of a fallback for one request; the balancer's state is read, never changed."""

    def __init__(self, balancer: Balancer):
        self._balancer = balancer

    def choose(self, call: Call, model: Model, chain: tuple[str, ...], unplaceable: bool) -> Choice | None:
        """The fallback `call` (asking for `model`, whose chain is `chain`) goes to; None: `model` answers it."""
        room = self._balancer.room
        own = room(model.name)
        if own is True:
            return None
        reason = SATURATED if own is False else UNPLACEABLE if unplaceable else DOWN
        catalog = call.view.catalog
        full: Model | None = None
        for name in chain:
            candidate = catalog.resolve(name)
            if candidate is None or not self._allowed(call, candidate):
                continue
            theirs = room(candidate.name)
            if theirs is True:
                return Choice(candidate, reason)
            if theirs is False and own is None and full is None:
                full = candidate
        return None if full is None else Choice(full, reason)

    @staticmethod
    def _allowed(call: Call, candidate: Model) -> bool:
        """Whether `call` could have asked for `candidate` itself: its key may use it, its engines serve the route."""
        key = call.api_key
        if key is not None and not keyauth.allows(key, candidate.name, candidate):
            return False
        return call.view.routes.allows(call.route, candidate.name)

