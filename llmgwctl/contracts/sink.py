"""`RouterSink`: what a router is told, by whichever source tells it.

Three sources feed a router -- the in-process reconciler's publisher, the
watch of a standalone router following a controller, and the static endpoint
file with its catalog directory -- and each pushes the same four things, once
per change, never a pull per request. The contract is written once, here, so
the control plane does not depend on the router: when the two run as separate
processes this becomes the watch stream and nothing above it changes.

A sink takes every call; a source makes the ones it has news for and never
asks which the sink understands. A source that knows what changed says so
(`change_endpoints`), so a push costs the change, not the tens of thousands
of endpoints a large fleet lists; one that only has the whole list sends it
(`set_endpoints`). The order a source keeps: the catalog first, then the
model states, then the endpoints, so a new model's endpoints never arrive
before the catalog that names it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from ..catalog import Catalog
from .endpoint import Endpoint
from .modelstate import ModelState


class RouterSink(Protocol):
    """Where catalogs, model states and ready endpoints go: the router (`router.server.Router`)."""

    def set_catalog(self, catalog: Catalog) -> None:
        """Make `catalog` the one new requests resolve against."""

    def set_model_states(self, states: Iterable[ModelState]) -> None:
        """Replace what is known of models without a ready replica (starting, or cannot be placed and why)."""

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the whole list of ready endpoints."""

    def change_endpoints(self, endpoints: tuple[Endpoint, ...], changed: Mapping[str, Endpoint | None]) -> None:
        """The list changed by `changed` since the sink was last told (by either call).

        `changed` maps each replica id whose endpoint came, changed or left to
        its Endpoint, or None if it left; `endpoints` is the whole new list,
        sorted by replica id, the same as `set_endpoints(endpoints)` would give.
        """
