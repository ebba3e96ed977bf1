"""End to end, a group across two agents: two real agent processes ("nodes" n1 and n2) on 127.0.0.1,
each following its own desired file and reporting to the real control API, run a head and its worker.

The head serves once its worker on the other agent joined; the worker is
reported ready with no URL and no port (nothing routes to it) and carries
its spec with the group; the worker killed with -9 takes its head down, and
both agents restart theirs until the group is whole again.
"""
from __future__ import annotations

import os
import signal

import pytest
import requests

from ..procs import free_port
from ..support import wait_until
from .harness import AgentProcess, kill_engines_under, replicas_by_id, write_desired


def slot(rank: int, rendezvous: int) -> dict:
    return {"group": "g-1", "rank": rank, "size": 2, "parallel": "pipeline", "head_host": "127.0.0.1",
            "port": rendezvous}


@pytest.fixture
def two_agents(tmp_path, controller):
    started: list[AgentProcess] = []
    dirs = []

    def start(node: str, desired, ports: str) -> AgentProcess:
        state = tmp_path / f"state-{node}"
        state.mkdir(exist_ok=True)
        dirs.append(state)
        agent = AgentProcess(["--state-dir", str(state), "--node", node, "--desired", str(desired), "--ports", ports,
                              "--controller", controller.url, "--grace", "5"], tmp_path / f"agent-{node}.log")
        started.append(agent)
        return agent
    yield start
    for agent in started:
        agent.stop()
    for state in dirs:
        kill_engines_under(state)


def latest_of(controller, node: str) -> dict | None:
    controller.latest()     # raises if the controller refused a report: the protocol drifted
    return next((r for r in reversed(controller.reports) if r["_node_in_path"] == node), None)


def replica(controller, node: str, rid: str) -> dict:
    return replicas_by_id(latest_of(controller, node)).get(rid, {})


def test_a_head_and_its_worker_on_two_agents(tmp_path, two_agents, controller):
    rendezvous = free_port()
    head_file, worker_file = tmp_path / "n1.json", tmp_path / "n2.json"
    write_desired(head_file, [{"id": "g-1", "model": "m", "engine": "fake", "gpus": 0, "group": slot(0, rendezvous)}])
    write_desired(worker_file, [{"id": "g-1-r1", "model": "m", "engine": "fake", "gpus": 0,
                                 "group": slot(1, rendezvous)}])
    low = free_port()
    two_agents("n1", head_file, f"{low}-{low + 9}")
    two_agents("n2", worker_file, f"{low + 10}-{low + 19}")

    wait_until(lambda: replica(controller, "n1", "g-1").get("state") == "ready", "the head ready on n1")
    wait_until(lambda: replica(controller, "n2", "g-1-r1").get("state") == "ready", "the worker ready on n2")
    head, worker = replica(controller, "n1", "g-1"), replica(controller, "n2", "g-1-r1")
    assert head["url"] == f"http://127.0.0.1:{head['port']}"
    assert worker["url"] is None and worker["port"] is None
    assert worker["spec"]["group"] == {**slot(1, rendezvous), "rpc_port": 0}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert requests.post(head["url"] + "/v1/chat/completions", json=chat, timeout=10).status_code == 200

    os.kill(worker["pid"], signal.SIGKILL)
    wait_until(lambda: replica(controller, "n1", "g-1").get("restarts", 0) >= 1
               and replica(controller, "n2", "g-1-r1").get("restarts", 0) >= 1, "both members restarted")
    wait_until(lambda: replica(controller, "n1", "g-1").get("state") == "ready"
               and replica(controller, "n2", "g-1-r1").get("state") == "ready", "the group whole again")
    head = replica(controller, "n1", "g-1")
    assert head["last_exit"] == 4, "the head exited because its worker left"
    assert requests.post(head["url"] + "/v1/chat/completions", json=chat, timeout=10).status_code == 200
