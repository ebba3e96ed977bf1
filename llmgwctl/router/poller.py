"""Polling each endpoint's `/metrics` for the load gauges the pick weighs.

Owns the polling loop only: fetch, hand the page to the engine drivers' metrics
adapter (`llmgwctl.engines.parse_load`), store the reading in the balancer. It
must not know any engine's metric names -- those belong to the drivers.

A failed poll stores nothing: the last reading ages past `stale_after` and the
balancer then treats the endpoint as unknown, not as idle. A poll is also the
router's health probe: one the engine does not answer at all (timed out,
refused, reset) is told to `Outliers`, which takes an endpoint that misses
several in a row out of routing until it answers again (outlier.py); any
answer, even an error status, is an answer. An engine without a metrics
path is not polled, so only its agent and failed requests watch it.

An engine is a peer the router does not trust, and its page is read where it
cannot stall the router: at most `max_bytes` of it (a larger page is not read
at all, and the refusal is counted and kept in `problems`, which status shows
as the replica's reason), never following a redirect (a 302 to an internal
URL would make the router fetch it every second), within the poll interval,
and parsed on one worker thread of the poller's own, not on the event loop.
The adapters themselves look only at the lines of the families they use
(`engines.base.samples`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp.connector import Connection
from aiohttp.http import RawResponseMessage
from aiohttp.streams import StreamReader

from ..aio import sleep_unless
from ..contracts import LoadReading
from .balancer import Balancer, EndpointState
from .config import DEFAULTS
from .outlier import Outliers

log = logging.getLogger("llmgw.router.poller")

ParseLoad = Callable[[str, str], "LoadReading | None"]


def parse_with_drivers(engine: str, text: str) -> LoadReading | None:
    """The default `ParseLoad`: the engine drivers' metrics adapters read the page."""
    from ..engines import parse_load  # the adapters live with the drivers
    return parse_load(engine, text)


# Interim (1xx) answers a /metrics page may come after. A real engine sends
# none to a GET (a 100 Continue answers a request that asked for it, which no
# scrape does); aiohttp reads each one as a message of its own, on the loop,
# and caps each one's headers but not how many arrive, so an engine sending
# 103s without end held the router's loop for half a second a poll.
MAX_INTERIM = 8


class InterimBound(ValueError):
    """More interim (1xx) answers than MAX_INTERIM before the page: the scrape is dropped, its connection closed."""


class BoundedResponse(aiohttp.ClientResponse):
    """The poller session's `response_class`: at most MAX_INTERIM interim answers before the real one."""

    async def start(self, connection: Connection) -> aiohttp.ClientResponse:  # aiohttp's own signature
        protocol = connection.protocol
        assert protocol is not None     # a connection being read from has its protocol
        read, seen = protocol.read, 0

        async def bounded() -> tuple[RawResponseMessage, StreamReader]:
            nonlocal seen
            message, payload = await read()
            seen += 1
            if seen > MAX_INTERIM + 1:
                protocol.close()        # nothing more of it is parsed
                raise InterimBound(f"sent more than {MAX_INTERIM} interim (1xx) answers before its page")
            return message, payload

        # An instance attribute over the class's method: this connection's reads only, for this answer.
        protocol.read = bounded     # type: ignore[method-assign]
        try:
            return await super().start(connection)
        finally:
            del protocol.read       # the class's own again, for the connection's next request


async def read_capped(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """An engine's answer body, or None when it is larger than `max_bytes`: refused by its length unread,
    else cut off as soon as what arrived passes the cap; either way the connection is closed, not read on."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        resp.close()
        return None
    parts: list[bytes] = []
    got = 0
    async for chunk in resp.content.iter_any():
        got += len(chunk)
        if got > max_bytes:
            resp.close()
            return None
        parts.append(chunk)
    return b"".join(parts)


class LoadPoller:
    """Reads every endpoint's /metrics each `interval`; `poll_once()` is one pass, for tests."""

    def __init__(self, balancer: Balancer, session: aiohttp.ClientSession, *,
                 interval: float = DEFAULTS.poll_interval, parse: ParseLoad = parse_with_drivers,
                 max_bytes: int = DEFAULTS.max_metrics_bytes, on_refused: Callable[[str], None] = lambda code: None,
                 outliers: Outliers | None = None, probe_timeout: float = DEFAULTS.probe_timeout):
        self._balancer = balancer
        self._session = session
        self.interval = interval
        self._parse = parse
        self.max_bytes = max_bytes
        self._on_refused = on_refused
        self._outliers = outliers       # None: misses eject nothing
        # A poll that takes longer than this is a miss (see config.probe_timeout);
        # it is also the longest a wedged engine holds up a pass, and with it
        # the other endpoints' readings.
        self.probe_timeout = probe_timeout
        self._timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
        self._resync = asyncio.Event()
        # One thread: parsing is Python holding the GIL, so a second thread
        # would only contend with the first and with the loop; pages queue for
        # it, and a pass waits for its own before sleeping, so they never pile up.
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        # replica id -> why its page gives no reading (too large, a redirect), until one does
        self.problems: dict[str, str] = {}

    def resync(self) -> None:
        """The endpoint list changed: poll now, so a new endpoint gets a reading without waiting a tick."""
        self._resync.set()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

    async def poll_once(self) -> None:
        states = [st for st in self._balancer.states() if st.endpoint.metrics_path is not None]
        if self.problems:
            listed = {st.replica_id for st in states}
            for rid in [r for r in self.problems if r not in listed]:
                del self.problems[rid]
        if self._outliers is not None:
            self._outliers.retain({st.replica_id for st in states})
        if states:
            await asyncio.gather(*(self._poll(st) for st in states))

    async def _poll(self, st: EndpointState) -> None:
        ep = st.endpoint
        if ep.metrics_path is None:
            return      # poll_once passes only endpoints with one; an engine without metrics is not polled
        sent = st.inflight      # ours when the engine counted: the balancer subtracts it (Balancer.record)
        asked = time.monotonic()
        try:
            async with self._session.get(ep.url + ep.metrics_path, timeout=self._timeout,
                                         allow_redirects=False) as resp:
                self._answered(st)
                if 300 <= resp.status < 400:
                    self._refuse(st, "metrics_redirect", f"/metrics answered {resp.status}, a redirect, which the "
                                 "router never follows")
                    return
                if resp.status != 200:
                    return
                data = await read_capped(resp, self.max_bytes)
        except InterimBound as exc:
            self._answered(st)      # it spoke, if too much
            self._refuse(st, "metrics_interim", f"/metrics {exc}")
            return
        except asyncio.TimeoutError:
            self._missed(st, f"each timed out after {self.probe_timeout:g} s", asked)
            return
        except ValueError:
            self._answered(st)      # aiohttp refusing a header line past its limits: an answer, if a bad one
            return
        except (aiohttp.ClientError, OSError) as exc:
            self._missed(st, f"last: {_why(exc)}", asked)
            return
        if data is None:
            self._refuse(st, "metrics_too_large", f"/metrics is larger than the router reads ({self.max_bytes} "
                         "bytes); no load reading")
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmgw-metrics")
        try:
            reading = await asyncio.get_running_loop().run_in_executor(self._worker, self._read_page, ep.engine, data)
        except RuntimeError:
            return      # the worker was shut down: the router is stopping
        except Exception:   # an adapter bug must not stop polling the other endpoints
            log.exception("reading %s metrics from %s", ep.engine, ep.url)
            return
        if reading is not None:
            self.problems.pop(st.replica_id, None)
        self._balancer.record(st, reading, sent)

    def _read_page(self, engine: str, data: bytes) -> LoadReading | None:
        # On the worker thread: decoding a few MiB is work too.
        return self._parse(engine, data.decode("utf-8", "replace"))

    def _answered(self, st: EndpointState) -> None:
        if self._outliers is not None:
            self._outliers.answered(st)

    def _missed(self, st: EndpointState, why: str, asked: float) -> None:
        if self._outliers is not None:
            self._outliers.missed(st, why, time.monotonic() - asked)

    def _refuse(self, st: EndpointState, code: str, reason: str) -> None:
        self._on_refused(code)
        if self.problems.get(st.replica_id) != reason:
            log.warning("endpoint %s: %s", st.replica_id, reason,
                        extra={"event": "metrics-refused", "endpoint": st.replica_id, "reason": code})
        self.problems[st.replica_id] = reason

    async def run(self) -> None:
        # Passes start every `interval` (not `interval` after the last one
        # ended): a wedged engine makes a pass last its probe timeout, and
        # the misses that eject it must come once an interval for the
        # ejection to come within seconds.
        while True:
            self._resync.clear()
            began = time.monotonic()
            await self.poll_once()
            await sleep_unless(max(0.0, began + self.interval - time.monotonic()), self._resync)


def _why(exc: BaseException) -> str:
    """A failed poll's cause in a few words (aiohttp's own messages run to a paragraph with the URL)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {exc.os_error.strerror or type(exc.os_error).__name__}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection closed without an answer"
    return type(exc).__name__
