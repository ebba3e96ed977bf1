"""Routing policies: how the router picks among a tier's candidates, one module per policy.

The shape is the llm-d inference scheduler's plugins: a policy is a small
module (least_load, round_robin, prefix, session) with a `Plugin` class
(plugin.py) holding the policy's state in this router; per request the
plugin hands the balancer's pick a one-method `Chooser`, or None to leave it
to least-load's two random choices. `Policy` is the registry: an Enum of the
names a catalog's `routing:` may say, each member carrying its plugin's
factory. `Policies` builds one plugin per member and dispatches a request by
looking its model's policy name up, so adding a policy is a module and a
member, not another branch.

The catalog names the policies too (`catalog.model.ROUTING_POLICIES` and
schemas/catalog.schema.json), but it is the layer below the router and
cannot import this Enum; tests/router/policies/test_registry.py fails when
any of the three disagree.

It must not know about HTTP or the catalog: the server hands it the parsed
body, the headers, the route's prompt reader and the model's policy name.
"""
from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from ..balancer import Balancer, Chooser
from .least_load import LeastLoad
from .plugin import Factory, Plugin, PromptReader, Settings
from .prefix import BLOCK_CHARS, TOKENS_PER_REQUEST, ModelIndex, Prefix, prompt_text
from .round_robin import RoundRobin
from .session import Session

__all__ = ["DEFAULT_POLICY", "LEAST_LOAD", "POLICIES", "Chooser", "Plugin", "Policies", "Policy", "Settings"]


class Policy(Enum):
    """The routing policies, by the name a catalog spells each with (`label`), with the factory of its plugin."""

    ROUND_ROBIN = ("round-robin", RoundRobin)
    LEAST_LOAD = ("least-load", LeastLoad)
    PREFIX = ("prefix", Prefix)
    SESSION = ("session", Session)

    def __init__(self, label: str, factory: Factory) -> None:
        self.label = label
        self.factory = factory


# Every policy's name, in the Enum's order: what a catalog may say.
POLICIES = tuple(p.label for p in Policy)
LEAST_LOAD = Policy.LEAST_LOAD.label
# A model whose catalog entry names no policy gets this one. bench/routing.py
# decided it: on shared prompts prefix+load cut TTFT p50 to ~0.05x of round
# robin and least-load; without reuse it makes least-load's very picks (it
# falls back to them when nothing is cached), so it costs only its hashing
# (~20 us a request at 2,000 tokens, bench/router.py).
DEFAULT_POLICY = Policy.PREFIX.label


class Policies:
    """The router's routing policies: `chooser()` per request, and a plugin per `Policy` behind it.

    Owned by the router next to its balancer; only the request path calls it.
    """

    def __init__(self, balancer: Balancer, *, block_chars: int = BLOCK_CHARS,
                 tokens_per_request: float = TOKENS_PER_REQUEST):
        self._balancer = balancer
        settings = Settings(balancer, block_chars, tokens_per_request)
        # By label, so a request's lookup is one dict probe with the catalog's string.
        self._plugins: dict[str, Plugin] = {p.label: p.factory(settings) for p in Policy}
        self._generation = balancer.generation

    def plugin(self, policy: Policy) -> Plugin:
        return self._plugins[policy.label]

    def index(self, model: str) -> ModelIndex:
        """The prefix policy's index of `model`'s endpoints."""
        prefix = self._plugins[Policy.PREFIX.label]
        assert isinstance(prefix, Prefix)
        return prefix.index(model)

    def _forget(self) -> None:
        """The endpoint list changed: every plugin drops what it keeps for endpoints no longer in it."""
        self._generation = self._balancer.generation
        alive = set(self._balancer.states())
        for plugin in self._plugins.values():
            plugin.forget(alive)

    def chooser(self, policy: str | None, model: str, doc: Mapping[str, Any],
                headers: Mapping[str, str] | None = None, *,
                prompt: PromptReader | None = prompt_text) -> Chooser | None:
        """What picks among a tier's candidates for this request; None: least-load (the balancer's own).

        `policy` is a `Policy` label; None or a name no member has gets
        least-load. `prompt` reads the prompt out of `doc` as the request's
        route says (routes.py); None: the route has none, so `prefix` picks by load.
        """
        plugin = self._plugins.get(policy) if policy is not None else None
        if plugin is None:
            return None
        if self._generation != self._balancer.generation:
            self._forget()
        return plugin.chooser(model, doc, headers, prompt)
