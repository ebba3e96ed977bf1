"""What a routing policy is: a `Plugin`, built from `Settings`, that hands the balancer's pick a `Chooser`.

The pick itself (balancer.py) decides which endpoints are candidates -- tier,
room, ejection -- and calls a `Chooser` only to pick among them, so no policy
can send a request where the balancer would not. A plugin is what holds a
policy's state across requests (a round-robin turn, a prefix index) and
makes one request's `Chooser` out of its body; None leaves the pick to the
balancer's own two random choices.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..balancer import Balancer, Chooser, EndpointState

__all__ = ["Chooser", "Factory", "Plugin", "PromptReader", "Settings"]

# How a request's route reads the prompt out of its body (routes.py): a chat's
# messages or a completion's prompt; None when the body holds none to hash.
PromptReader = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True, slots=True)
class Settings:
    """What every plugin is built from: the router's balancer and the prefix cost model's two numbers."""

    balancer: Balancer
    # Characters a prefix block covers (prefix.BLOCK_CHARS says why the default).
    block_chars: int
    # Uncached prompt tokens worth one more request ahead (prefix.TOKENS_PER_REQUEST).
    tokens_per_request: float


class Plugin(Protocol):
    """One routing policy's state in one router, and the `Chooser` it makes for each request.

    A Protocol declared here, by the registry that builds plugins, so a
    policy is a module with a class of this shape and a `Policy` member; it
    needs no base class and the registry knows no policy's insides.
    """

    def chooser(self, model: str, doc: Mapping[str, Any], headers: Mapping[str, str] | None,
                prompt: PromptReader | None) -> Chooser | None:
        """What picks among a tier's candidates for this request; None: least-load (the balancer's own)."""
        ...

    def forget(self, alive: set[EndpointState]) -> None:
        """The endpoint list changed: drop what is kept for endpoints not in `alive`, and models without any."""
        ...


Factory = Callable[[Settings], Plugin]
