"""Prometheus metrics for the router and the control plane, every name under `llmgw_`.

Two registries, one per HTTP face, so each `/metrics` shows what that face
owns: `RouterMetrics` (the router's port) and `ControlMetrics` (the control
API). Both include the process collector (CPU, memory, open fds). Each
module lists the names it exports, by owner:

    router     RouterMetrics: the router's requests, tokens, keys, refusals, followed files
    endpoints  per endpoint: stable slot labels, what a request records, the gauges read at scrape
    control    ControlMetrics: the catalog, the reconciler, replicas, nodes, GPUs, the control API
    kit        what both are built of: loop-local children, hand-written text families, build info

It must not change what it observes, and it knows only the narrow read-only
views handed to it (`RouterProbe`, a callable returning a `ControlStatus`).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST

from .control import ControlMetrics
from .endpoints import EndpointMetrics, EndpointSlots, RouterProbe
from .kit import render
from .router import RouterMetrics

__all__ = ["CONTENT_TYPE_LATEST", "ControlMetrics", "EndpointMetrics", "EndpointSlots", "RouterMetrics",
           "RouterProbe", "render"]
