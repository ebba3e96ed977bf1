"""A group's members on an agent: the head probed as any replica, the worker never over HTTP.

Real fake-engine processes (a head and its worker, engines/fake_group.py)
under an in-process agent driven pass by pass with an injected clock: the
worker has no port and no URL, is ready once it ran `WORKER_SETTLE`, is
failed when it exits and restarted with back-off; the head's rendezvous
port, inside the agent's port range, is never handed to an engine; an agent
restart adopts both processes.
"""
from __future__ import annotations

import json
import os
import signal

import aiohttp

from llmgwctl.agent import FAILED, READY, STARTING, PortRange
from llmgwctl.agent.members import WORKER_SETTLE
from llmgwctl.contracts import AgentReport, GroupSlot, ReplicaSpec

from ..support import FakeClock, until
from .test_core import make_agent


def members(rendezvous: int, size: int = 2) -> list[ReplicaSpec]:
    slots = [GroupSlot(group="g-1", rank=rank, size=size, parallel="pipeline", head_host="127.0.0.1",
                       port=rendezvous) for rank in range(size)]
    return [ReplicaSpec(id=s.member_id(s.rank), model="m", profile="p", engine="fake", source="m", gpus=0,
                        group=s) for s in slots]


class Probes:
    """Which replicas the agent probed over HTTP, wrapped round its real prober."""

    def __init__(self, agent):
        self.ids: list[str] = []
        real = agent.prober.probe

        async def probe(r):
            self.ids.append(r.spec.id)
            return await real(r)
        agent.prober.probe = probe


async def until_state(agent, rid: str, state, what: str) -> None:
    """Pass after pass until replica `rid` is in `state` (the engines are real: bounded real time)."""
    await until(lambda: agent.replicas[rid].state == state, what, every=0.05, nudge=agent.reconcile_once)


async def test_a_worker_is_ready_without_a_probe_and_reported_with_no_url(tmp_path, port_range, groups):
    clock = FakeClock()
    ports = PortRange.parse(port_range)
    # The rendezvous is the range's first port: the one the head's API would take if the agent did not hold it.
    head_spec, worker_spec = members(ports.low)
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, gpus=())
        probes = Probes(agent)
        agent.set_desired([head_spec, worker_spec])
        await agent.reconcile_once()
        head, worker = agent.replicas["g-1"], agent.replicas["g-1-r1"]
        groups.extend([head.pgid, worker.pgid])
        assert head.state == worker.state == STARTING
        assert head.port is not None and head.port != ports.low and worker.port is None

        # The head passes its health check once the worker joined (real processes, real time);
        # the worker is still settling: the clock has not moved.
        await until_state(agent, "g-1", READY, "the head ready once its worker joined")
        assert worker.state == STARTING
        clock.advance(WORKER_SETTLE)
        await agent.reconcile_once()
        assert worker.state == READY
        for _ in range(3):      # ready engines are probed every pass: the head only
            await agent.reconcile_once()
        assert probes.ids and set(probes.ids) == {"g-1"}

        report = AgentReport.from_dict(json.loads(json.dumps(agent.report().to_dict())))
        reps = {r.id: r for r in report.replicas}
        assert reps["g-1"].url == f"http://127.0.0.1:{head.port}"
        assert reps["g-1-r1"].url is None and reps["g-1-r1"].port is None and reps["g-1-r1"].state == READY
        assert reps["g-1-r1"].spec is not None and reps["g-1-r1"].spec.group == worker_spec.group
        await agent.close()


async def whole_group(agent, specs, groups):
    """Start `specs` (a head and its worker) on `agent` and pass until the head is ready: (head, worker)."""
    agent.set_desired(specs)
    await agent.reconcile_once()
    head, worker = agent.replicas["g-1"], agent.replicas["g-1-r1"]
    groups.extend([head.pgid, worker.pgid])
    await until_state(agent, "g-1", READY, "the head ready once its worker joined")
    return head, worker


async def test_a_dead_worker_fails_its_group_and_both_restart_with_backoff(tmp_path, port_range, groups):
    clock = FakeClock()
    head_spec, worker_spec = members(PortRange.parse(port_range).low)
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, gpus=())
        head, worker = await whole_group(agent, [head_spec, worker_spec], groups)
        first = (head.pid, worker.pid)

        os.kill(worker.pid, signal.SIGKILL)
        # The worker's exit is seen at once; the head, which lost a rank, exits on its own.
        await until_state(agent, "g-1-r1", FAILED, "the worker failed")
        await until_state(agent, "g-1", FAILED, "the head failed after its worker died")
        assert worker.state == FAILED and worker.last_exit == -signal.SIGKILL
        assert head.last_exit == 4 and "worker rank 1 left the group" in "\n".join(head.last_log)

        clock.advance(2)      # past the first back-off
        await agent.reconcile_once()
        groups.extend([head.pgid, worker.pgid])
        assert head.restarts == worker.restarts == 1 and (head.pid, worker.pid) != first
        await until_state(agent, "g-1", READY, "the restarted head ready once its restarted worker joined")
        await agent.close()


async def test_an_agent_restart_adopts_both_members(tmp_path, port_range, groups):
    clock = FakeClock()
    head_spec, worker_spec = members(PortRange.parse(port_range).low)
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, gpus=())
        await whole_group(agent, [head_spec, worker_spec], groups)
        pids = {rid: r.pid for rid, r in agent.replicas.items()}
        await agent.close()
        saved = json.loads((tmp_path / "replicas.json").read_text())["replicas"]
        assert {r["id"]: r["port"] for r in saved}["g-1-r1"] is None

        again = make_agent(tmp_path, port_range, session, clock, gpus=())
        probes = Probes(again)
        assert sorted(await again.adopt()) == ["g-1", "g-1-r1"]
        again.set_desired([head_spec, worker_spec])
        await until_state(again, "g-1", READY, "the adopted head ready")
        # No clock moved: a worker that outlived the agent's last run has settled, and is ready at once.
        await again.reconcile_once()
        assert {rid: (r.pid, r.state, r.restarts) for rid, r in again.replicas.items()} == {
            rid: (pid, READY, 0) for rid, pid in pids.items()}
        assert set(probes.ids) == {"g-1"}
        await again.close()
