"""Scenario 4: the controller killed and restarted while a standalone router serves.

The router (`llmgwctl router --controller URL`) keeps its last endpoints and
catalog while the controller is gone, and must not lose them when the new
controller comes up knowing nothing yet: during its settling window that
controller adopts what the agents report. Clients see no failure, no engine
restarts, and once settled the status is the one before the kill.
"""
import signal
import time

import requests

from tests.e2e.fleet import alive, wait_until

from .load import Sampler, SteadyLoad, summary

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    aliases: [chat]
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: big
    profiles: [{name: a100, engine: fake, pool: a100, gpus: 2}]
"""


def comparable(status: dict) -> dict:
    """The status minus what moves by itself (events, counters, timings, in-flight requests, the load they make)."""
    return {
        "catalog": status["catalog"]["version"],
        # The autoscaler's load is a time-averaged in-flight count: under the test's load it moves.
        "models": [{**m, "autoscale": {k: v for k, v in m["autoscale"].items() if k not in ("load", "needed")}}
                   for m in status["models"]],
        "replicas": [{k: v for k, v in r.items() if k not in ("inflight", "idle_seconds", "adopted")}
                     for r in status["replicas"]],
        "nodes": [{k: v for k, v in n.items() if k not in ("last_seen_seconds", "reports")} for n in status["nodes"]],
    }


class EndpointCounts(Sampler):
    """What the standalone router holds, read from its /healthz every 20 ms while the controller restarts."""

    def __init__(self, router: str):
        super().__init__(lambda session: session.get(router + "/healthz", timeout=5).json()["endpoints"],
                         0.02, failed=None)


def test_controller_restart_behind_a_standalone_router_costs_clients_nothing(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    fleet.start_controller()
    fleet.start_agent("n1", "2xA100-80GB", "a100")
    fleet.start_agent("n2", "none")
    wait_until(lambda: len(fleet.ready("talk")) == 2 and fleet.ready("big"), "every replica ready")
    router = fleet.start_router()
    wait_until(lambda: fleet.status()["settled"], "the first controller settled")
    before = comparable(fleet.status())
    seen_version = requests.get(fleet.control + "/api/v1/watch/endpoints", params={"timeout": 0}, timeout=5).json()["version"]

    with SteadyLoad(router, ["talk", "chat", "big"], workers=4) as load, EndpointCounts(router) as held:
        load.wait_for(20)
        started = time.monotonic()
        fleet.kill_controller(signal.SIGKILL)
        load.wait_for(20)       # the router serves alone
        fleet.start_controller()
        # What a router that follows the watch is told right after the restart,
        # asked at once rather than whenever its reconnect backoff happens to fire.
        first = requests.get(fleet.control + "/api/v1/watch/endpoints", params={"after": seen_version}, timeout=45).json()
        wait_until(lambda: fleet.status()["settled"], "the new controller settled")
        wait_until(lambda: comparable(fleet.status()) == before, "the status of before the kill")
        recovered = time.monotonic() - started
        load.wait_for(40)       # and the router has followed the new controller for a while
    after = comparable(fleet.status())
    restarts = sum(r["restarts"] for r in fleet.status()["replicas"])
    figure(f"controller down and settled again in {recovered:.1f} s behind a standalone router; "
           f"{summary(load.outcomes)}; engine restarts {restarts}; endpoints the router held: "
           f"min {min(n for n in held.seen if n is not None)} of {len(before['replicas'])}; "
           f"first watch answer after the restart: {len(first['endpoints'])} endpoints")
    assert load.failures() == [], load.failures()[:5]
    # The new controller never told a router that had a list a partial one.
    assert len(first["endpoints"]) == len(before["replicas"]) and first["version"] != seen_version
    assert None not in held.seen and min(held.seen) == len(before["replicas"]), held.seen
    assert restarts == 0
    assert after == before


def test_catalog_edited_while_the_controller_is_down_is_carried_out_after_its_restart(fleet, figure):
    """A `git pull` while the controller restarts: one model removed, one added.

    The new controller adopts what still belongs, starts what is new, and has
    the removed model's engine stopped -- the agent must take the new list even
    though it still holds a version number from the controller's previous life.
    """
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    (fleet.catalogs / "gone.yaml").write_text(
        "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: gone\n    profiles: [{name: cpu, engine: fake, gpus: 0}]\n")
    fleet.start_controller()
    fleet.start_agent("n1", "2xA100-80GB", "a100")
    fleet.start_agent("n2", "none")
    wait_until(lambda: len(fleet.ready("talk")) == 2 and fleet.ready("big") and fleet.ready("gone"), "every replica ready")
    before = {r["id"]: r["pid"] for r in fleet.replicas() if r["model"] != "gone"}
    (gone,) = fleet.ready("gone")
    router = fleet.start_router()
    with SteadyLoad(router, ["talk", "big"], workers=2) as load:
        load.wait_for(10)
        fleet.kill_controller(signal.SIGKILL)
        (fleet.catalogs / "gone.yaml").unlink()
        (fleet.catalogs / "more.yaml").write_text(
            "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"
            "  - name: fresh\n    replicas: 2\n    profiles: [{name: cpu, engine: fake, gpus: 0}]\n")
        started = time.monotonic()
        fleet.start_controller()
        wait_until(lambda: len(fleet.ready("fresh")) == 2, "the model added while the controller was down ready")
        added = time.monotonic() - started
        wait_until(lambda: not alive(gone["pid"]), "the engine of the model removed while the controller was down stopped")
        removed = time.monotonic() - started
        load.wait_for(10)
    kept = {r["id"]: r["pid"] for r in fleet.replicas() if r["model"] != "fresh"}
    figure(f"catalog edited while the controller was down: added model ready {added:.1f} s and removed model's "
           f"engine stopped {removed:.1f} s after the restart; {len(kept)} of {len(before)} replicas kept with their "
           f"processes; {summary(load.outcomes)}")
    assert kept == before
    assert load.failures() == [], load.failures()[:5]
