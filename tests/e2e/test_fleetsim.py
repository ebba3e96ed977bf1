"""A simulated fleet of 50 nodes and 3 routers against a real `serve --no-local-agent` (tests/fleetsim.py).

It converges -- every replica started once, ready, and on every router, one
of them asking for whole answers as routers did before delta answers -- and
a controller killed with SIGKILL and started again adopts every replica:
nothing started, nothing stopped, every router whole again on the new
controller's versions. The simulator runs on its own event loop in a thread;
the test reads it on that loop (`Sim.read`), never across threads. Run twice:
the routers on the simulator's loop, and in a process of their own as the
bench runs them (the parent's views built from the child's lines).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import requests

from ..fleetsim import ENGINE_YAML, SimFleet, controller_answer_matches
from .fleet import Fleet, wait_until

NODES, ROUTERS, REPLICAS = 50, 3, 120
CATALOG = ("apiVersion: llmgw/v1\nkind: Catalog\n" + ENGINE_YAML + "models:\n" + "".join(
    f"  - name: m{i}\n    source: sim/m{i}\n    replicas: {REPLICAS // 10}\n"
    f"    profiles: [{{name: p, engine: sim, gpus: 1}}]\n" for i in range(10)))


class Sim:
    """A SimFleet on its own loop in a thread; `read(fn)` runs fn(fleet) on that loop and returns its value."""

    def __init__(self, url: str, router_process: bool):
        # Heartbeats every 0.5 s, as the e2e agents do: well inside the fleet's 2 s node timeout.
        self.fleet = SimFleet(url, NODES, routers=ROUTERS, heartbeat=0.5, gpus=4, ready_after=(0.05, 0.3),
                              router_process=router_process)
        # One router as they were before delta answers: it asks without the parameter and is answered whole.
        self.fleet.routers[0].delta = False
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self):
        await self.fleet.run(self.stop)

    def read(self, fn):
        async def call():
            return fn(self.fleet)
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=30)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=30)


def whole(fleet: SimFleet, versions=frozenset()):
    """Every replica ready and on every router (with a version not in `versions`)."""
    running = fleet.running()
    ready = {rid for rid, (_, r) in running.items() if r.state.value == "ready"}
    return (len(running) == REPLICAS and len(ready) == REPLICAS
            and all(r.endpoints.keys() == ready and r.version not in versions for r in fleet.routers))


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_controller()
        yield fleet
    finally:
        fleet.close()


@pytest.mark.parametrize("router_process", [False, True], ids=["routers-in-process", "router-process"])
def test_a_simulated_fleet_converges_and_a_restarted_controller_adopts_it_whole(fleet, router_process):
    sim = Sim(fleet.control, router_process)
    sim.thread.start()
    try:
        wait_until(lambda: sim.read(whole), "every replica ready on its node and on every router")
        starts, stops = sim.read(lambda f: (f.starts(), f.stops()))
        assert starts == REPLICAS and stops == 0, "each replica started once"
        deltas = sim.read(lambda f: [r.deltas for r in f.routers])
        assert deltas[0] == 0 and all(deltas[1:]), "the older router whole, the others by deltas, all whole"
        versions = frozenset(sim.read(lambda f: {r.version for r in f.routers}))

        fleet.kill_controller()
        fleet.start_controller(keep_ports=True)
        wait_until(lambda: fleet.status()["settled"], "the restarted controller to settle")
        wait_until(lambda: sim.read(lambda f: whole(f, versions)), "every router whole on the new controller")
        status = fleet.status()
        assert len(status["replicas"]) == REPLICAS and all(r["adopted"] for r in status["replicas"])
        # Past the settling window, with every node heard again: a controller that
        # would start or stop anything has placed it by the pass after its reports.
        reports = sim.read(lambda f: {a.name: a.reports for a in f.agents})
        wait_until(lambda: sim.read(lambda f: all(a.reports >= reports[a.name] + 2 for a in f.agents)),
                   "two more reports from every node")
        passes = fleet.status()["passes"]
        wait_until(lambda: fleet.status()["passes"] > passes, "a pass after them")
        assert sim.read(lambda f: (f.starts(), f.stops())) == (starts, stops), "adopted: nothing restarted"
        assert sim.read(lambda f: whole(f, versions))
        raw = requests.get(fleet.control + "/api/v1/watch/endpoints", params={"after": "0"}, timeout=30).content
        assert controller_answer_matches(raw) and b'"replica_id"' in raw
    finally:
        try:
            sim.close()
        except concurrent.futures.TimeoutError:
            pass
