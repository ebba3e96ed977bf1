"""The agent loads and unloads a replica's LoRA adapters on its running engine, as its spec places them.

A real agent pass by pass with an injected clock, launching real fake
engines: adapters are loaded once the engine is ready, reported, unloaded
when the spec drops them, retried after back-off when a load fails (with
the engine's reason in the report), and loaded again into a restarted engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import aiohttp

from llmgwctl.agent import READY, Agent, PortRange
from llmgwctl.contracts import AdapterSpec, ReplicaSpec
from llmgwctl.engines import driver_for

from ..support import FakeClock, local_server, until

SPEC = ReplicaSpec(id="r1", model="base", profile="p", engine="fake", source="base", gpus=0, lora_slots=2, lora_rank=8)


def states(agent: Agent) -> dict[str, tuple[str, str]]:
    (replica,) = agent.report().replicas
    return {a.name: (a.state, a.reason) for a in replica.adapters}


async def converged(agent: Agent, want: dict[str, str], what: str) -> None:
    await until(lambda: {n: s for n, (s, _) in states(agent).items()} == want, what,
                nudge=agent.reconcile_once, every=0.05)


async def served(session: aiohttp.ClientSession, agent: Agent) -> list[str]:
    url = agent.url(agent.replicas["r1"].port) + "/v1/models"
    async with session.get(url) as resp:
        return [c["id"] for c in (await resp.json())["data"]]


async def test_adapters_follow_the_spec_on_the_running_engine(tmp_path, port_range):
    clock = FakeClock()
    a_dir = tmp_path / "a"
    a_dir.mkdir()
    async with aiohttp.ClientSession() as session:
        agent = Agent(node="n", gpus=(), state_dir=tmp_path / "state", ports=PortRange.parse(port_range),
                      driver_for=driver_for, session=session, clock=clock)
        try:
            spec = dataclasses.replace(SPEC, adapters=(AdapterSpec("a", str(a_dir)), AdapterSpec("b", str(tmp_path / "b"))))
            agent.set_desired([spec])
            await until(lambda: agent.replicas["r1"].state == READY, "the engine ready", nudge=agent.reconcile_once)
            pid = agent.replicas["r1"].pid
            await converged(agent, {"a": "loaded", "b": "failed"}, "a loaded, b failed")
            assert "no such directory" in states(agent)["b"][1]
            assert await served(session, agent) == ["base", "a"]
            # b's directory appears: loaded once its back-off (2 s first) has passed, not before.
            (tmp_path / "b").mkdir()
            await agent.reconcile_once()
            assert states(agent)["b"][0] == "failed"
            clock.advance(3)
            await converged(agent, {"a": "loaded", "b": "loaded"}, "b loaded after its back-off")
            # The spec drops a: unloaded from the same engine.
            agent.set_desired([dataclasses.replace(spec, adapters=(AdapterSpec("b", str(tmp_path / "b")),))])
            await converged(agent, {"b": "loaded"}, "a unloaded")
            assert await served(session, agent) == ["base", "b"] and agent.replicas["r1"].pid == pid
            # The engine dies: restarted, and b is loaded into the new one.
            os.kill(pid, signal.SIGKILL)
            clock.advance(5)
            await until(lambda: agent.replicas["r1"].state == READY and agent.replicas["r1"].pid != pid,
                        "the engine restarted", nudge=lambda: (clock.advance(1), agent.reconcile_once())[1])
            await converged(agent, {"b": "loaded"}, "b loaded into the restarted engine")
            assert await served(session, agent) == ["base", "b"]
        finally:
            agent.set_desired([])
            await until(lambda: not agent.replicas, "the engine stopped", nudge=agent.reconcile_once, timeout=30)
            await agent.close()


async def test_an_adapter_leaving_waits_for_its_requests_in_flight(tmp_path, port_range):
    clock = FakeClock()
    async with aiohttp.ClientSession() as session:
        agent = Agent(node="n", gpus=(), state_dir=tmp_path / "state", ports=PortRange.parse(port_range),
                      driver_for=driver_for, session=session, clock=clock)
        try:
            # 0.05 s a token: a 60-token answer runs for 3 s.
            spec = dataclasses.replace(SPEC, args=("--decode-time-per-token", "0.05"),
                                       adapters=(AdapterSpec("a", "org/a"),))
            agent.set_desired([spec])
            await until(lambda: agent.replicas["r1"].state == READY, "the engine ready", nudge=agent.reconcile_once)
            await converged(agent, {"a": "loaded"}, "a loaded")
            url = agent.url(agent.replicas["r1"].port) + "/v1/chat/completions"
            running = asyncio.ensure_future(session.post(url, json={
                "model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "ignore_eos": True}))
            await until(lambda: "a" in requests_on(agent), "the request running", every=0.05)
            agent.set_desired([dataclasses.replace(spec, adapters=())])
            await agent.reconcile_once()
            await asyncio.sleep(0.3)
            await agent.reconcile_once()
            assert states(agent) == {"a": ("unloading", "")}, "unloaded under a running request"
            answer = await running
            assert answer.status == 200
            answer.release()
            await converged(agent, {}, "a unloaded once its request finished")
        finally:
            agent.set_desired([])
            await until(lambda: not agent.replicas, "the engine stopped", nudge=agent.reconcile_once, timeout=30)
            await agent.close()


def requests_on(agent: Agent) -> set[str]:
    import requests

    page = requests.get(agent.url(agent.replicas["r1"].port) + "/metrics", timeout=5).text
    line = next(x for x in page.splitlines() if x.startswith("vllm:lora_requests_info{"))
    running = line.split('running_lora_adapters="')[1].split('"')[0]
    return set(filter(None, running.split(",")))


async def test_a_launch_time_engine_is_read_for_its_numbers_retried_with_back_off(tmp_path):
    """llama.cpp: nothing loaded by the agent, only its listing read, once per engine process."""
    from aiohttp import web

    from llmgwctl.agent.adapters import AdapterKeeper
    from llmgwctl.agent.replica import Replica
    from llmgwctl.backoff import Backoff

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF")
    b.write_bytes(b"GGUF")
    answers = [web.Response(status=503, text="loading model")]
    asked: list[str] = []

    async def listing(request: web.Request) -> web.Response:
        asked.append(request.path)
        return answers.pop(0) if answers else web.json_response([{"id": 0, "path": str(a), "scale": 1.0}])
    app = web.Application()
    app.router.add_get("/lora-adapters", listing)
    clock = FakeClock()
    spec = ReplicaSpec(id="r1", model="base", profile="p", engine="llamacpp", source="/m.gguf", gpus=0,
                       adapters=(AdapterSpec("a", str(a)), AdapterSpec("b", str(b))))
    async with local_server(app) as url, aiohttp.ClientSession() as session:
        replica = Replica(spec=spec, backoff=Backoff(initial=1.0, cap=10.0, clock=clock), state=READY, pid=4242,
                          port=int(url.rsplit(":", 1)[1]))
        keeper = AdapterKeeper(session, clock=clock)

        def statuses():
            keeper.sync([replica], lambda p: f"http://127.0.0.1:{p}")
            return {s.name: (s.state, s.engine_id, s.reason) for s in keeper.statuses(replica)}
        # The engine not answering yet: failed with its words, not asked again before the back-off.
        await until(lambda: statuses()["a"][0] == "failed", "the listing failed")
        assert "503" in statuses()["a"][2] and len(asked) == 1
        clock.advance(3)
        # Then read: a by its number; b, which the engine does not list, failed with why.
        await until(lambda: statuses()["a"][0] == "loaded", "a numbered")
        assert statuses() == {"a": ("loaded", 0, ""),
                              "b": ("failed", None, "the engine does not list it at /lora-adapters")}
        clock.advance(600)
        statuses()
        assert len(asked) == 2      # once per engine process
        await keeper.close()
