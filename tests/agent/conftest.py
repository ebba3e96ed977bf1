"""Agent test fixtures: the real controller (recording what agents send it), agent processes, and no engine left behind."""
from __future__ import annotations

import os
import signal

import pytest

from ..controlplane import ControlPlaneThread
from ..procs import free_port
from .harness import AgentProcess, kill_engines_under

# Long-polls held 3 s, not the real 30 s: a test sees several polls, and a
# poll held when a test makes the controller fail ends within seconds.
HOLD = 3.0


@pytest.fixture
def controller(tmp_path):
    """The real control API on loopback, its loops not started: a test sets desired lists itself."""
    catalogs = tmp_path / "catalogs"
    catalogs.mkdir()
    c = ControlPlaneThread(catalogs, hold=HOLD)
    yield c
    c.close()


@pytest.fixture
def port_range():
    """A 20-port range around a port the kernel just said was free: no fixed ports in tests."""
    port = free_port()
    low = max(1024, min(port, 65535 - 20))
    return f"{low}-{low + 19}"


@pytest.fixture
def agents(tmp_path):
    """`start(*args)` -> AgentProcess; at the end every agent is stopped and every engine it started killed."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    started: list[AgentProcess] = []

    def start(*args: str) -> AgentProcess:
        agent = AgentProcess(["--state-dir", str(state_dir), *args], tmp_path / f"agent-{len(started)}.log")
        started.append(agent)
        return agent

    start.state_dir = state_dir
    yield start
    for agent in started:
        agent.stop()
    kill_engines_under(state_dir)


@pytest.fixture
def groups():
    """Process groups to kill at the end, whatever happened."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
