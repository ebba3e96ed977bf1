"""Polling each endpoint's `/metrics` for the load gauges the pick weighs.

Owns the polling loop only: fetch, hand the page to the engine drivers' metrics
adapter (`llmgwctl.engines.parse_load`), store the reading in the balancer. It
must not know any engine's metric names -- those belong to the drivers.

A failed poll stores nothing: the last reading ages past `stale_after` and the
balancer then treats the endpoint as unknown, not as idle.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

from ..aio import sleep_unless
from ..contracts import LoadReading
from .balancer import Balancer, EndpointState
from .config import DEFAULTS

log = logging.getLogger("llmgw.router.poller")

ParseLoad = Callable[[str, str], "LoadReading | None"]


def parse_with_drivers(engine: str, text: str) -> LoadReading | None:
    """The default `ParseLoad`: the engine drivers' metrics adapters read the page."""
    from ..engines import parse_load     # the adapters live with the drivers
    return parse_load(engine, text)


class LoadPoller:
    """Reads every endpoint's /metrics each `interval`; `poll_once()` is one pass, for tests."""

    def __init__(self, balancer: Balancer, session: aiohttp.ClientSession, *,
                 interval: float = DEFAULTS.poll_interval, parse: ParseLoad = parse_with_drivers):
        self._balancer = balancer
        self._session = session
        self.interval = interval
        self._parse = parse
        # A poll that takes longer than the interval is as good as missing; the
        # timeout keeps a wedged engine from holding up the pass for the others.
        self._timeout = aiohttp.ClientTimeout(total=interval)
        self._resync = asyncio.Event()

    def resync(self) -> None:
        """The endpoint list changed: poll now, so a new endpoint gets a reading without waiting a tick."""
        self._resync.set()

    async def poll_once(self) -> None:
        states = [st for st in self._balancer.states() if st.endpoint.metrics_path is not None]
        if states:
            await asyncio.gather(*(self._poll(st) for st in states))

    async def _poll(self, st: EndpointState) -> None:
        ep = st.endpoint
        if ep.metrics_path is None:
            return      # poll_once passes only endpoints with one; an engine without metrics is not polled
        sent = st.inflight      # ours when the engine counted: the balancer subtracts it (Balancer.record)
        try:
            async with self._session.get(ep.url + ep.metrics_path, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        try:
            reading = self._parse(ep.engine, text)
        except Exception:   # an adapter bug must not stop polling the other endpoints
            log.exception("reading %s metrics from %s", ep.engine, ep.url)
            return
        self._balancer.record(st, reading, sent)

    async def run(self) -> None:
        while True:
            self._resync.clear()
            await self.poll_once()
            await sleep_unless(self.interval, self._resync)
