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
import os

from ..aio import sleep_unless
from ..contracts import ReplicaState
from . import core
from .core import (
    DRAIN_GRACE,
    REPLACE_AFTER,
    SETTLE,
    IncrementalMismatch,
    Reconciler,
    Replica,
)
from .desired import LONG_POLL, DesiredStore

log = logging.getLogger("llmgw.reconciler")

# A pass every second even when nothing woke us: heartbeat timeouts, drain
# progress and idle timeouts are all judged on a pass, and a pass over a
# fleet's worth of records is milliseconds.
TICK = 1.0
# A pass nothing woke costs at most this share of a core: after a pass that
# took P seconds, the next unwoken one waits max(TICK, P / IDLE_SHARE). A small
# fleet's pass is milliseconds, so it still runs every TICK; 5,000 nodes with
# 20,000 replicas take a few hundred ms a pass, which every second was most of
# a core spent finding nothing to do (issue 19). What must not wait for it
# still runs a pass within a TICK: a wake (a catalog swap, a report that
# changed something, the router), a node past its report timeout, a replica
# draining, the settling window (see `_due`).
IDLE_SHARE = 0.05
# Woken passes, back to back, take at most this share of the loop: after a
# pass of P seconds the next one starts P / WOKEN_SHARE - P later at the
# earliest. A pass runs on the loop that also answers agents, and while a
# fleet converges nearly every report is news: at 5,000 nodes passes of a
# second or more ran back to back, reports waited behind them past the node
# timeout, and nodes that had reported were taken for lost (issue 19). Half:
# a change still waits at most one pass's length more, and for a small fleet
# that is milliseconds. An urgent wake (a catalog swap, a request waiting for
# a model with no replica) skips this wait: it is one pass asked for by an
# operator or a client, not the stream of reports that spacing is for, and
# a change's first pass -- the one that places it -- no longer waits behind
# the pass before it (issue 19: a catalog change's way to the nodes).
WOKEN_SHARE = 0.5

__all__ = ["DRAIN_GRACE", "LONG_POLL", "REPLACE_AFTER", "SETTLE", "TICK", "DesiredStore", "Reconciler", "Replica", "run"]


async def run(reconciler: Reconciler, wake: asyncio.Event, stop: asyncio.Event, tick: float = TICK,
              urgent: asyncio.Event | None = None, woken_share: float = WOKEN_SHARE) -> None:
    """Run `reconcile_once` on every tick and whenever `wake` is set, until `stop`. Never raises but on cancel.

    `urgent`, set together with `wake`, also skips the spacing of woken
    passes (WOKEN_SHARE): the next pass starts as soon as this one is done.

    Supervised: a pass that raises is logged with its traceback, counted and
    shown as degraded in status and /metrics (`Reconciler.pass_failed`), and
    the next tick runs a pass from the records the failed one left: being
    level-triggered, a later pass redoes whatever the failed one did not.
    """
    loop = asyncio.get_running_loop()
    urgent = urgent if urgent is not None else asyncio.Event()
    while not stop.is_set():
        wake.clear()
        urgent.clear()
        started = loop.time()
        try:
            reconciler.reconcile_once()
        except IncrementalMismatch as exc:
            if not core.EXIT_ON_MISMATCH:
                reconciler.pass_failed(exc)
            else:
                # Only in a serve the test suite started (core.CHECK_INCREMENTAL): end the process, so the
                # test that got here fails at once and says why, rather than a pass logged as failed.
                log.critical("reconcile pass: %s", exc)
                os._exit(70)
        except Exception as exc:  # noqa: BLE001 -- a bug in one pass must not stop the control plane
            reconciler.pass_failed(exc)
        took = loop.time() - started
        deadline = started + max(tick, took / IDLE_SHARE)
        while not await sleep_unless(min(tick, max(0.0, deadline - loop.time())), wake, stop):
            if loop.time() >= deadline or _due(reconciler):
                break
        if not stop.is_set():
            await sleep_unless(max(0.0, started + took / woken_share - loop.time()), stop, urgent)


def _due(reconciler: Reconciler) -> bool:
    """Whether a pass is needed now although nothing woke the loop: what a tick used to be for.

    Cheap looks, no pass: a node past its report timeout (it leaves the router
    on the next pass), a replica draining (it stops once its requests are
    done), a draining node's replica waiting out its surge, the settling
    window (it may end on any pass).
    """
    if not reconciler.settled or reconciler.inventory.overdue():
        return True
    return (any(rec.state == ReplicaState.DRAINING for rec in reconciler.replicas.values())
            or reconciler.maintenance.waiting())
