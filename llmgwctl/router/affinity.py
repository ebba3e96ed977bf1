"""Responses affinity on the request path: a request naming a stored response goes to the replica that stored it.

`Affinity` joins the store of bindings (responses.py) and the balancer: it
records what an answer on a binding route carried (`learned`), and finds
the endpoint a request naming a response must go to (`endpoint`), or
refuses it with why. The request path pins the call to that endpoint and
never tries another (no other replica holds the response); the answer path
tells it each id it reads.

It must not know HTTP beyond the refusals, nor how answers are read.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from ..catalog import Catalog
from . import auth as keyauth
from . import responses
from .balancer import Balancer, EndpointState
from .call import Call, Refused

__all__ = ["Affinity"]

log = logging.getLogger("llmgw.router")


class Affinity:
    """Response id -> the replica that stored it, checked against what the balancer routes to now."""

    __slots__ = ("store", "_balancer", "_counted")

    def __init__(self, store: responses.ResponseStore, balancer: Balancer,
                 counted: Callable[[str], None] = lambda outcome: None):
        self.store = store
        self._balancer = balancer
        # Told each outcome: routed, not_found, replica_gone, model_mismatch, unreachable, unread (the metric's).
        self._counted = counted

    def learned(self, call: Call, state: EndpointState, response_id: str | None) -> None:
        """`state`'s engine answered `call` with a response named `response_id` (None: none was read)."""
        if response_id is None:
            self._counted("unread")
            log.warning("replica %s answered %s without a response id the router could read; a later request "
                        "naming it will not find it", state.replica_id, call.route.path)
            return
        key = call.api_key.name if call.api_key is not None else None
        self.store.remember(response_id, state.replica_id, state.endpoint.url, state.endpoint.model, key)

    def endpoint(self, call: Call, response_id: str, asked: str | None = None) -> EndpointState:
        """The endpoint that stored `response_id` for `call`'s key; Refused (404, 400, 403) when there is none.

        `asked`: the model the request names (canonical), when it names one:
        a response is continued only by the model that made it, whose replica holds it.
        """
        key = call.api_key
        binding = self.store.lookup(response_id, key.name if key is not None else None) \
            if responses.valid_id(response_id) else None
        if binding is None:
            self._counted("not_found")
            raise Refused(responses.not_found(response_id))
        call.model = binding.model
        if asked is not None and asked != binding.model:
            self._counted("model_mismatch")
            raise Refused(responses.other_model(response_id, binding, asked))
        catalog: Catalog = call.view.catalog
        if key is not None and asked is None and not keyauth.allows(key, binding.model,
                                                                    catalog.resolve(binding.model)):
            # The key that made it, since limited to other models: it may no longer reach this one.
            raise Refused(keyauth.forbidden(binding.model))
        state = self._balancer.state_of(binding.replica)
        if state is None or state.endpoint.url != binding.url or state.endpoint.model != binding.model:
            self._counted("replica_gone")
            raise Refused(responses.replica_gone(response_id, binding))
        self._counted("routed")
        return state

    def unreachable(self, response_id: str, detail: str, call: Call) -> Refused:
        """The refusal for a pinned endpoint that did not take the request."""
        self._counted("unreachable")
        key = call.api_key
        binding = self.store.lookup(response_id, key.name if key is not None else None)
        if binding is None:
            return Refused(responses.not_found(response_id))
        return Refused(responses.replica_unreachable(response_id, binding, detail))
