"""The reconciler: desired (catalog) vs actual (agent reports), every pass; and each node's desired list.

Owns replica records (ids it chose, adoption, drain, idle scale-down, wake),
the per-node desired lists agents long-poll, and publishing ready replicas as
the router's endpoints. It must not know HTTP, processes or the router's
internals: see the protocols in `core` and the records in `llmgwctl.contracts`.
Importing it loads neither the router nor aiohttp (tests/reconciler holds that).
"""
from __future__ import annotations

import asyncio
import logging

from ..aio import sleep_unless
from .core import DRAIN_GRACE, REPLACE_AFTER, SETTLE, EndpointSink, ModelStateSink, Reconciler, Replica
from .desired import LONG_POLL, DesiredStore

log = logging.getLogger("llmgw.reconciler")

# A pass every second even when nothing woke us: heartbeat timeouts, drain
# progress and idle timeouts are all judged on a pass, and a pass over a
# fleet's worth of records is milliseconds.
TICK = 1.0

__all__ = ["DRAIN_GRACE", "LONG_POLL", "REPLACE_AFTER", "SETTLE", "TICK", "DesiredStore", "EndpointSink",
           "ModelStateSink", "Reconciler", "Replica", "run"]


async def run(reconciler: Reconciler, wake: asyncio.Event, stop: asyncio.Event, tick: float = TICK) -> None:
    """Run `reconcile_once` on every tick and whenever `wake` is set, until `stop`. Never raises but on cancel.

    Supervised: a pass that raises is logged with its traceback, counted and
    shown as degraded in status and /metrics (`Reconciler.pass_failed`), and
    the next tick runs a pass from the records the failed one left: being
    level-triggered, a later pass redoes whatever the failed one did not.
    """
    while not stop.is_set():
        wake.clear()
        try:
            reconciler.reconcile_once()
        except Exception as exc:  # noqa: BLE001 -- a bug in one pass must not stop the control plane
            reconciler.pass_failed(exc)
        await sleep_unless(tick, wake, stop)
