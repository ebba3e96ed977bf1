"""Health probes of the engines on this node: starting ones until they pass, ready ones while they run.

A starting engine is probed until its health check passes (then it is
ready) or its start timeout runs out (then it is restarted). A ready engine
is probed every pass too: one that stops answering -- SIGSTOPped, a hung GPU,
a deadlocked API server -- keeps its process and its port, so nothing else
on the node notices. After `unhealthy_after` failed probes in a row it is
reported not ready (starting again, with the reason), which takes it out of
the router's endpoint list through the controller; if it passes again it is
ready again, and if it has not passed within `restart_after` it is restarted
like a crashed engine. The router ejects it sooner on its own probes
(router/outlier.py): that is what routing needs (and a partition between
router and engine is invisible from here); this is what the controller
needs -- a replica that is really not serving is reported so, and one wedged
for long is restarted instead of holding its GPUs.

It decides and probes; the agent core (core.py) applies what it decides. It
knows no engine by name: the health path is the driver's, kept on the replica.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from .replica import Replica

# 1 s pass: crash detection and health polling latency, against a handful of
# /proc reads and local HTTP probes per replica per pass.
TICK = 1.0
# 2 s per health probe: a local engine that is up answers in milliseconds; a
# slow answer during loading counts as not ready yet, and it is re-probed next
# pass. For a ready engine it is the bound on silence that counts as a
# failure: twice the router's own (router.config.probe_timeout), because the
# agent's verdict restarts engines and must not take a loaded one for a hung one.
PROBE_TIMEOUT = 2.0
# A starting engine is probed between passes too: the moment its health passes
# is the moment it can serve, and a notice one pass late is up to a second of
# a cold start that its model's queue pays for (traced from placement to the
# router, the wait for the agent's next pass was the largest share of what
# was not the engine's own start-up). The wait between probes
# grows with the time it has been starting -- 5 % of it, from 50 ms up to one
# pass -- so readiness is noticed within about 5 % of the start-up's length:
# ~0.2 s after a 4 s start, at most a pass after vLLM's minutes. That is ~50
# loopback probes over the first 4 s, then one a pass: nothing next to an
# engine loading weights.
PROBE_SHARE, PROBE_MIN = 0.05, 0.05
# Failed probes in a row before a ready engine is reported not ready: one
# is noise (a probe that met a long GC pause), three are several seconds of
# an engine that answers /health in milliseconds saying nothing.
UNHEALTHY_AFTER = 3
# How long a ready engine that turned unhealthy may take to pass again before
# it is restarted: past any stall a working engine has once it served (a GC
# pause, a blocking compile of a new shape are seconds), short enough that a
# wedged GPU's replica is back serving within a couple of minutes. Its
# process group is stopped as after a crash -- SIGKILL ends a stopped process.
RESTART_UNHEALTHY_AFTER = 60.0


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How ready engines are judged; 0 for `unhealthy_after` or `restart_after`: never."""

    timeout: float = PROBE_TIMEOUT
    unhealthy_after: int = UNHEALTHY_AFTER
    restart_after: float = RESTART_UNHEALTHY_AFTER


DEFAULT_POLICY = HealthPolicy()


class Prober:
    """Probes an engine's health path on this node: "" when it passed, else why not."""

    def __init__(self, session: aiohttp.ClientSession, host: str, timeout: float = PROBE_TIMEOUT):
        self._session = session
        self._host = host
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.timeout = timeout

    def url(self, r: Replica) -> str:
        # Only a replica with a pid is probed, and _start and adoption set its port with its pid.
        assert r.port is not None
        # An engine bound to every address is probed on loopback: the probe must
        # not depend on how this node's advertised address routes.
        host = "127.0.0.1" if self._host in ("0.0.0.0", "::") else self._host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{r.port}{r.health_path}"

    async def probe(self, r: Replica) -> str:
        try:
            async with self._session.get(self.url(r), timeout=self._timeout) as resp:
                return "" if resp.status == 200 else f"answered {resp.status}"
        except asyncio.TimeoutError:
            return f"timed out after {self.timeout:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return f"failed: {type(exc).__name__}"


def next_probe(r: Replica, now: float) -> float:
    """When a starting engine is probed next between passes (PROBE_SHARE)."""
    return now + min(TICK, max(PROBE_MIN, PROBE_SHARE * (now - r.started_at)))


def missed(r: Replica, why: str, now: float, took: float, policy: HealthPolicy) -> str:
    """A ready `r` failed a probe (`why`) that took `took` s and ended `now`: the reason to report it
    not ready when this miss is one too many, else ""."""
    if r.misses == 0:
        r.first_miss = now - took
    r.misses += 1
    if not policy.unhealthy_after or r.misses < policy.unhealthy_after:
        return ""
    return (f"unhealthy: no answer to {r.misses} health probes in {max(1.0, now - r.first_miss):.0f} s "
            f"(last {why}); restarted if it does not pass within {policy.restart_after:g} s"
            if policy.restart_after else
            f"unhealthy: no answer to {r.misses} health probes in {max(1.0, now - r.first_miss):.0f} s (last {why})")
