"""The `least-load` policy: the balancer's own pick, two random choices by load per unit of weight.

No chooser and no state: the pick (balancer.py) already is least-load, so
this plugin only gives the name a place in the registry.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..balancer import EndpointState
from .plugin import PromptReader, Settings


class LeastLoad:
    """A plugin whose every request is left to the balancer's two random choices."""

    __slots__ = ()

    def __init__(self, settings: Settings) -> None:
        del settings    # nothing to configure: the balancer holds the loads

    def chooser(self, model: str, doc: Mapping[str, Any], headers: Mapping[str, str] | None,
                prompt: PromptReader | None) -> None:
        return None

    def forget(self, alive: set[EndpointState]) -> None:
        return None
