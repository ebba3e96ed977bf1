"""The agent's own check of catalog engines: refused whatever the desired list says, stopped when no longer allowed."""
from __future__ import annotations

import functools
import logging

import aiohttp

from llmgwctl.agent import FAILED, STARTING, STOPPING
from llmgwctl.contracts import ReplicaSpec
from llmgwctl.engines import AllowedEngines, driver_for

from ..support import FakeClock
from .harness import group_alive
from .test_core import make_agent

SHELLY = ReplicaSpec(id="s1", model="m", profile="p", engine="shelly", source="m", gpus=0,
                     command=("sh", "-c", "exec sleep 300"))
ALLOW_SH = functools.partial(driver_for, allowed=AllowedEngines.parse(["shelly=sh"]))


async def test_a_desired_replica_of_an_engine_not_allowed_is_failed_with_the_reason(tmp_path, port_range):
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, FakeClock())
        agent.set_desired([SHELLY])
        await agent.reconcile_once()
        r = agent.replicas["s1"]
        assert r.state == FAILED and r.pid is None and r.next_start is None   # nothing a retry changes
        assert r.reason.startswith("refused: catalog engine 'shelly' is not allowed on this node")
        report = agent.report()
        assert report.replicas[0].reason == r.reason and "shelly" not in report.engines
        await agent.reconcile_once()
        assert agent.replicas["s1"].pid is None
        await agent.close()


async def test_an_adopted_engine_the_node_no_longer_allows_is_stopped(tmp_path, port_range, groups, caplog):
    async with aiohttp.ClientSession() as session:
        first = make_agent(tmp_path, port_range, session, FakeClock(), driver_for=ALLOW_SH, grace=2)
        first.set_desired([SHELLY])
        await first.reconcile_once()
        pid = first.replicas["s1"].pid
        groups.append(first.replicas["s1"].pgid)
        assert first.replicas["s1"].state == STARTING and pid is not None
        await first.close()

        # The operator restarts the agent without --allow-engine shelly=sh.
        second = make_agent(tmp_path, port_range, session, FakeClock(), grace=2)
        with caplog.at_level(logging.INFO, logger="llmgw.agent"):
            assert await second.adopt() == ["s1"]
            r = second.replicas.get("s1")
            if r is not None:             # the stop may be over already: sleep dies at once on SIGTERM
                assert r.state == STOPPING
                await r.group_task
        assert "s1" not in second.replicas and group_alive(pid) == []
        assert "replica s1: stopping: refused: catalog engine 'shelly' is not allowed on this node" in caplog.text
        await second.close()
