"""How long held long-polls take to resume after the change that answers them, on a loop busy with other work.

    python3 -m bench.longpoll [--busy-ms 0.5] [--steps 0,100,400] [--polls 1000] [--watches 50]

On uvloop (as serve runs), POLLS agents' desired long-polls are held in the
real `AgentService._desired_or_logs` over a real `DesiredStore`, and WATCHES
routers' watches in a real `Broadcast`. Then the loop is given other work:
N callbacks of BUSY ms each that keep rescheduling themselves, so every step
of the loop runs N x BUSY ms of it (what a stream of agent reports does to
serve during a rollout). The watch is bumped and every node's list changed
at once; printed is when the watches and the polls resumed, p50 and max.
A wake that takes k steps of the loop costs k x the step: this is what it
counts, in milliseconds.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from types import SimpleNamespace
from typing import cast

from llmgwctl.aio import run
from llmgwctl.contracts import ReplicaSpec
from llmgwctl.control.agentapi import AgentService
from llmgwctl.control.broadcast import Broadcast
from llmgwctl.control.controller import Controller
from llmgwctl.control.logs import LogRelay
from llmgwctl.reconciler.desired import DesiredStore


async def once(busy: float, steps: int, polls: int, watches: int) -> str:
    loop = asyncio.get_running_loop()
    running = True

    def other_work() -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        if running:
            loop.call_soon(other_work)

    store, watch = DesiredStore(first_version=1), Broadcast()
    api = AgentService.__new__(AgentService)    # only what the desired route's wait reads
    # A stand-in for the Controller: the wait reads only these two of it.
    api.c = cast(Controller, SimpleNamespace(desired=store, logs=LogRelay()))
    nodes = [f"n{i}" for i in range(polls)]
    for n in nodes:
        store.set(n, ())
    resumed: dict[object, float] = {}

    async def poll(node: str) -> None:
        await api._desired_or_logs(node, store.get(node)[0], 30)      # type: ignore[index]
        resumed[node] = time.perf_counter()

    async def follow(i: int) -> None:
        await watch.wait(watch.version, 30)
        resumed[i] = time.perf_counter()

    tasks = [asyncio.ensure_future(poll(n)) for n in nodes] + [asyncio.ensure_future(follow(i)) for i in range(watches)]
    await asyncio.sleep(0.1)                    # every poll and watch held
    for _ in range(steps):
        loop.call_soon(other_work)
    await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    watch.bump()
    spec = ReplicaSpec(id="r", model="m", profile="p", engine="e", source="s", gpus=1)
    for n in nodes:
        store.set(n, (spec,))
    await asyncio.wait(tasks, timeout=60)
    running = False
    w = sorted(resumed[i] - t0 for i in range(watches))
    d = sorted(resumed[n] - t0 for n in nodes)
    return (f"loop step ~{busy * steps * 1e3:4.0f} ms: watches resumed p50 {statistics.median(w) * 1e3:5.0f} ms, "
            f"max {w[-1] * 1e3:5.0f}; desired polls p50 {statistics.median(d) * 1e3:5.0f} ms, max {d[-1] * 1e3:5.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy-ms", type=float, default=0.5, help="ms of one piece of other work (about an agent report)")
    p.add_argument("--steps", default="0,100,400", help="pieces of other work per loop step, comma-separated runs")
    p.add_argument("--polls", type=int, default=1000)
    p.add_argument("--watches", type=int, default=50)
    a = p.parse_args()
    for n in (int(x) for x in a.steps.split(",")):
        print(run(once(a.busy_ms / 1000, n, a.polls, a.watches)))


if __name__ == "__main__":
    main()
