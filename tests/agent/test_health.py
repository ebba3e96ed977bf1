"""A ready engine that stops answering its health check (agent/health.py): reported not ready with the
reason after a few failed probes, ready again when it passes, restarted when it stays silent too long.

The engine is real and really stopped (SIGSTOP); only the agent's clock is
simulated, so the restart bound is passed without waiting for it.
"""
from __future__ import annotations

import asyncio
import os
import signal

import aiohttp

from llmgwctl.agent import FAILED, READY, STARTING
from llmgwctl.agent.health import HealthPolicy
from llmgwctl.contracts import ReplicaState

from ..support import FakeClock
from .harness import group_alive
from .test_core import fake_spec, make_agent

# Short probes: a stopped engine's probe runs to its timeout, in real time.
POLICY = HealthPolicy(timeout=0.3, unhealthy_after=3, restart_after=60)


async def _ready(agent, rid):
    await agent.reconcile_once()
    r = agent.replicas[rid]
    for _ in range(300):          # bounded: the engine's cold start on a busy machine
        await agent.reconcile_once()
        if r.state == READY:
            return r
        await asyncio.sleep(0.1)
    raise AssertionError(f"{rid} not ready: {r.reason}")


async def test_a_wedged_engine_is_reported_not_ready_and_ready_again_when_it_answers(tmp_path, port_range,
                                                                                      groups):
    clock = FakeClock()
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, host="127.0.0.1", health=POLICY)
        agent.set_desired([fake_spec("a", gpus=0)])
        r = await _ready(agent, "a")
        groups.append(r.pgid)
        os.kill(r.pid, signal.SIGSTOP)
        try:
            for _ in range(2):
                clock.advance(1)
                await agent.reconcile_once()
            assert r.state == READY     # two misses are not yet a verdict
            clock.advance(1)
            await agent.reconcile_once()
            (reported,) = agent.report().replicas
            assert reported.state == ReplicaState.STARTING, reported
            assert reported.reason.startswith("unhealthy: no answer to 3 health probes in 2 s (last timed out "
                                              "after 0.3 s)"), reported.reason
        finally:
            os.kill(r.pid, signal.SIGCONT)
        for _ in range(50):         # bounded: the resumed engine's next answer
            clock.advance(1)
            await agent.reconcile_once()
            if r.state == READY:
                break
        assert r.state == READY and r.reason == "" and r.restarts == 0
        await agent.close()


async def test_an_engine_wedged_past_the_bound_is_restarted(tmp_path, port_range, groups):
    clock = FakeClock()
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, host="127.0.0.1", health=POLICY, grace=0.5)
        agent.set_desired([fake_spec("a", gpus=0)])
        r = await _ready(agent, "a")
        groups.append(r.pgid)
        wedged = r.pid
        os.kill(wedged, signal.SIGSTOP)
        try:
            for _ in range(3):
                clock.advance(1)
                await agent.reconcile_once()
            assert r.state == STARTING
            clock.advance(30)
            await agent.reconcile_once()
            assert r.state == STARTING      # not yet past restart_after
            clock.advance(31)
            await agent.reconcile_once()
            assert r.state == FAILED and "health check did not pass for 60 s" in r.reason, r.reason
            await r.group_task              # SIGKILL ends a stopped process too
            assert group_alive(wedged) == []
        finally:
            try:
                os.kill(wedged, signal.SIGCONT)
            except ProcessLookupError:
                pass
        clock.advance(5)
        r = await _ready(agent, "a")
        groups.append(r.pgid)
        assert r.restarts == 1 and r.pid != wedged
        await agent.close()
