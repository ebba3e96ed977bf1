"""Talking to the controller: the agent's side of the agent protocol.

Owns the two HTTP calls an agent makes -- POST its report, long-poll its
node's desired replicas -- and the loops that keep them going through a
controller that is down, restarting or answering garbage. The agent always
dials out; nothing dials in. It must not know how replicas are run: it hands
desired specs to the agent core and sends whatever `report()` returns (an
`AgentReport`, turned into the protocol's JSON by its own `to_dict`).

What a failing controller does to this node: nothing. The last desired list
holds, engines keep running, and the loops retry with a growing delay.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from ..aio import cancel_and_wait, follow_file, sleep_unless
from ..backoff import Backoff
from ..contracts import AgentReport, ReplicaSpec
from .desired import DesiredFile, parse_replicas
from .errors import ControllerError, DesiredError, RateLimited

log = logging.getLogger("llmgw.agent.controller")

# A report every 5 s: the controller marks a node unreachable after 3 missed
# reports, so a dead node leaves the router within ~15 s, while one small POST
# per node every 5 s is nothing for the controller even with hundreds of nodes.
HEARTBEAT = 5.0
# The controller holds a long-poll ~30 s; 45 s leaves room for a slow answer
# and still notices a connection that died silently (NAT, a dropped VPN).
LONG_POLL_TIMEOUT = 45.0
# 10 s for a report: it is one small POST; longer means the controller is
# overloaded, and a fresh report later is worth more than this one.
REPORT_TIMEOUT = 10.0
# Retries against a failing controller: 1 s first (a controller restart takes
# seconds), doubling to 30 s so a fleet of agents does not hammer a controller
# that is coming back, yet every node rejoins within 30 s of it being up. Each
# delay is jittered (llmgwctl.backoff), so the fleet's retries are spread over
# the interval instead of all landing in the same moment.
RETRY_INITIAL, RETRY_CAP = 1.0, 30.0
# A desired file is re-read on every change its directory's watch reports, and
# checked (one stat) every 10 s besides: the check catches what inotify cannot
# see (an edit made on another NFS client), and a missing directory is looked
# for again as often.
FILE_RECHECK = 10.0
# A chunk of engine log (agent.logs): the controller may hold it up to 10 s for
# a slow reader before it answers (control.logs.DELIVER_TIMEOUT); 20 s covers that.
LOGS_TIMEOUT = 20.0
# A 429's Retry-After is followed within these bounds: at least a tenth of a
# second (a 0 would make the next report hit the same empty bucket at once),
# at most 30 s (RETRY_CAP) whatever a controller says, so a node never goes
# quiet for long on one answer. The controller counts a refused report as a
# sign of life, so waiting it out keeps the node reachable.
RATE_LIMIT_MIN, RATE_LIMIT_MAX = 0.1, RETRY_CAP


class DesiredSink(Protocol):
    """Where desired lists go: the agent core. So these loops need no more of the agent than this."""

    desired: tuple[ReplicaSpec, ...] | None

    def set_desired(self, specs: tuple[ReplicaSpec, ...]) -> None: ...


class ControllerClient:
    def __init__(self, base_url: str, node: str, session: aiohttp.ClientSession, token: str | None = None,
                 instance_id: str = "", on_log_requests: Callable[[Any], None] | None = None):
        self.base = base_url.rstrip("/") + f"/api/v1/agents/{node}"
        self.session = session
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Sent with every long-poll: the controller gives the node's replicas only
        # to the agent process that speaks for it (a second one gets 409).
        self.instance_id = instance_id
        # The controller asks for engine logs in its desired answers (it cannot
        # dial in); they go here (agent.logs.LogSender.handle), before the list.
        self.on_log_requests = on_log_requests

    async def post_logs(self, request_id: str, body: dict[str, Any]) -> bool:
        """POST one chunk of a requested log; True while the controller still has a reader for it."""
        url = f"{self.base}/logs/{request_id}"
        try:
            async with self.session.post(url, json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=LOGS_TIMEOUT)) as resp:
                if resp.status >= 300 and resp.status != 410:
                    log.warning("POST %s: HTTP %d: %s", url, resp.status, (await resp.text())[:200])
                return resp.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("POST %s: %s; that log stream ends", url, exc or type(exc).__name__)
            return False

    async def post_report(self, body: dict[str, Any]) -> tuple[str, ...]:
        """POST the report; what the controller took but refused of it (claims beyond the node's token).

        RateLimited on a 429, ControllerError on anything else that is not a success.
        """
        try:
            async with self.session.post(self.base + "/report", json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=REPORT_TIMEOUT)) as resp:
                if resp.status == 429:
                    raise RateLimited(f"POST {self.base}/report: HTTP 429: {(await resp.text())[:200]}",
                                      _retry_after(resp.headers.get("Retry-After")))
                if resp.status >= 300:
                    raise ControllerError(f"POST {self.base}/report: HTTP {resp.status}: {(await resp.text())[:200]}")
                try:
                    answer = await resp.json(content_type=None)
                except ValueError:
                    return ()
                refused = answer.get("refused") if isinstance(answer, dict) else None
                return tuple(str(x)[:500] for x in refused[:20]) if isinstance(refused, list) else ()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ControllerError(f"POST {self.base}/report: {exc or type(exc).__name__}") from None

    async def get_desired(self, after: int) -> tuple[int, tuple[ReplicaSpec, ...]] | None:
        """One long-poll: (version, specs), or None when the controller says nothing changed.

        Raises ControllerError when unreachable or failing, DesiredError when
        the answer is not a desired list (the version comes with it, so the
        caller can wait for the next one instead of refetching a bad one).
        """
        url = self.base + "/desired"
        try:
            params = {"after": str(after), **({"instance": self.instance_id} if self.instance_id else {})}
            async with self.session.get(url, params=params, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=LONG_POLL_TIMEOUT)) as resp:
                if resp.status in (204, 304):
                    return None
                if resp.status >= 300:
                    raise ControllerError(f"GET {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                try:
                    doc = await resp.json(content_type=None)
                except ValueError as exc:
                    raise DesiredError(f"GET {url}: answer is not JSON: {exc}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ControllerError(f"GET {url}: {exc or type(exc).__name__}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("version"), int):
            raise DesiredError(f"GET {url}: expected {{\"version\": N, \"replicas\": [...]}}, got {str(doc)[:200]}")
        if doc.get("log_requests") and self.on_log_requests is not None:
            self.on_log_requests(doc["log_requests"])
        try:
            return doc["version"], parse_replicas(doc.get("replicas", []), f"{url} version {doc['version']}")
        except DesiredError as exc:
            exc.version = doc["version"]
            raise


async def report_loop(client: ControllerClient, report: Callable[[], AgentReport], changed: asyncio.Event,
                      stop: asyncio.Event, heartbeat: float = HEARTBEAT,
                      delivered: asyncio.Event | None = None) -> None:
    """POST the report on every change and at least every `heartbeat` seconds; set `delivered` once one is taken."""
    # Retries of a report wait at most one heartbeat, not RETRY_CAP: a restarted
    # controller adopts for a settling window of about three heartbeats and
    # then treats a node it has not heard from as running nothing -- a node
    # still backing off after a longer outage got duplicates of its replicas
    # started elsewhere. Retrying at the heartbeat rate costs a controller that
    # is down no more than this agent's heartbeats cost it when it is up.
    initial, cap = min(RETRY_INITIAL, heartbeat), min(RETRY_CAP, heartbeat)
    retry = Backoff(initial=initial, cap=cap)
    failing = limited = False
    refused_before: tuple[str, ...] = ()
    while not stop.is_set():
        changed.clear()
        try:
            refused = await client.post_report(report().to_dict())
        except RateLimited as exc:
            # Not a failure: the controller is up and heard us. Wait what it
            # asks (changes meanwhile are sent together after it), then send
            # the state as it is then; nothing is lost, only later.
            if not limited:
                log.info("%s; sending the node's state again in %.1f s", exc, exc.retry_after)
            limited = True
            await sleep_unless(exc.retry_after, stop)
            continue
        except ControllerError as exc:
            delay = retry.failure()
            if not failing:
                log.warning("%s; retrying (jittered, at most %.1f s apart at first, %.1f s later) -- engines keep running",
                            exc, initial, cap)
            failing = True
            # A change does not cut a retry delay short: that would hammer a controller that is down.
            await sleep_unless(delay, stop)
            continue
        if delivered is not None:
            delivered.set()
        if failing:
            log.info("controller reachable again: report delivered")
        if refused and refused != refused_before:
            log.warning("the controller took this node's report without what its token does not allow: %s",
                        "; ".join(refused))
        failing = limited = False
        refused_before = refused
        retry.reset()
        await sleep_unless(heartbeat, stop, changed)


def _retry_after(header: str | None) -> float:
    """A 429's Retry-After in seconds (RFC 9110: whole seconds; a date or junk is read as 1), within bounds."""
    try:
        seconds = float(header) if header is not None else 1.0
    except ValueError:
        seconds = 1.0
    if seconds != seconds:      # NaN
        seconds = 1.0
    return max(RATE_LIMIT_MIN, min(RATE_LIMIT_MAX, seconds))


async def desired_loop(client: ControllerClient, agent: DesiredSink, stop: asyncio.Event,
                       reported: asyncio.Event | None = None) -> None:
    """Long-poll the node's desired replicas and hand every new list to the agent.

    With `reported`, the first poll waits until this agent's first report was
    taken: the controller answers a node's desired list only to the agent that
    speaks for it, and an agent restarted within the node timeout becomes that
    one by its report (which proves it is the holder's successor). A poll sent
    before it would be refused 409, as a second agent for the node is.

    Any version other than ours counts as new, not only a greater one:
    versions come from the controller's clock, and one whose clock stepped
    back (or an older controller, counting from 1 after every restart) would
    otherwise freeze this node until it passed our old number.
    """
    version = 0
    retry = Backoff(initial=RETRY_INITIAL, cap=RETRY_CAP)
    failing = False
    if reported is not None:
        await sleep_unless(None, reported, stop)
    while not stop.is_set():
        poll = asyncio.ensure_future(client.get_desired(version))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({poll, stopper}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Cancelled from outside (the agent shutting down): take the poll
            # down with us, or its failure would surface as an unretrieved error.
            await cancel_and_wait(poll, stopper)
            raise
        stopper.cancel()
        if not poll.done():
            await cancel_and_wait(poll)
            return
        try:
            got = poll.result()
        except ControllerError as exc:
            if not failing:
                log.warning("%s; keeping the last desired list and retrying", exc)
            failing = True
            await sleep_unless(retry.failure(), stop)
            continue
        except DesiredError as exc:
            log.error("%s -- keeping the last good desired list", exc)
            # Skip the bad version; the controller answers again when it has another.
            version = _version_of(exc, version)
            await sleep_unless(retry.failure(), stop)
            continue
        if failing:
            log.info("controller reachable again: following its desired list")
        failing = False
        retry.reset()
        if got is None:
            continue
        new_version, specs = got
        if new_version != version or agent.desired is None:
            log.info("desired version %d: %d replica(s)", new_version, len(specs))
            version = new_version
            agent.set_desired(specs)


def _version_of(exc: DesiredError, current: int) -> int:
    return exc.version if exc.version is not None else current


async def file_loop(follow: DesiredFile, agent: DesiredSink, stop: asyncio.Event, recheck: float = FILE_RECHECK) -> None:
    """Follow `--desired FILE` instead of a controller: read it on every change, until `stop`."""
    async def read() -> None:
        specs = await asyncio.to_thread(follow.poll)
        if specs is not None:
            agent.set_desired(specs)

    missing = False
    while not stop.is_set():
        await read()    # what changed before this watch was armed, or while there was none
        try:
            async for _ in follow_file(follow.path, stop, recheck=recheck):
                await read()
            missing = False
        except FileNotFoundError:
            if not missing:
                log.error("%s: its directory does not exist; looking again every %.0f s", follow.path, recheck)
            missing = True
        await sleep_unless(recheck, stop)    # the watch ended without `stop` (its directory went): not at once
