"""SIGTERM always stops `serve` within its grace (issue 13, "loops that cannot die silently").

A real `llmgwctl serve` with its local agent and fake engines. The grace is
what llmgwctl-serve(1) documents: requests in flight get SHUTDOWN_DRAIN, the
local engines SHUTDOWN_ENGINES, the loops SHUTDOWN_LOOPS; serve must be gone
within their sum, however many streams are open, whatever the catalog makes
each reconcile pass do and whatever the watcher is loading. That bound is
the correctness bound a supervisor's stop timeout relies on (systemd sends
SIGKILL at 90 s), not a speed target; the only slack added is for the Python
interpreter's own exit on a loaded machine.

As documented, serve stops its local agent's engines on the way out (the
engines of remote agents outlive it); the tests hold that too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest
import requests

from llmgwctl.control.serve import SHUTDOWN_GRACE
from tests.e2e.fleet import Fleet, wait_until

# The interpreter's own exit after the grace (threads joined, logs flushed).
EXIT_SLACK = 10.0
pytestmark = pytest.mark.timeout(SHUTDOWN_GRACE + 180)

# Two tokens a second: a reply of 1000 tokens would take 500 s, far past any grace.
SLOW = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: slow
    profiles: [{name: cpu, engine: fake, gpus: 0, args: [--tokens-per-second, "2", --max-num-seqs, "1024"]}]
"""


def at_bounds() -> str:
    # The rest of the catalog's whole replica budget (slow wants one), on GPUs
    # this node does not have: every pass places nothing and explains 99,999
    # unplaceable replicas.
    out = ["apiVersion: llmgw/v1", "kind: Catalog", "models:"]
    for i in range(100):
        out += [f"  - name: big{i}", f"    replicas: {999 if i == 0 else 1000}",
                "    profiles: [{name: h100, engine: fake, pool: h100, gpus: 8}]"]
    return "\n".join(out) + "\n"


class InFlight:
    """Requests held open against the router, each on its own thread, until the server ends them."""

    def __init__(self, router: str):
        self.router = router
        self.threads: list[threading.Thread] = []
        self.started = 0
        self.ended: list[str] = []
        self._lock = threading.Lock()

    def _one(self, stream: bool) -> None:
        body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True,
                "stream": stream}
        try:
            with requests.post(self.router + "/v1/chat/completions", json=body, stream=True,
                               timeout=(10, SHUTDOWN_GRACE + EXIT_SLACK)) as resp:
                with self._lock:
                    self.started += 1
                for _ in resp.iter_lines():
                    pass
            outcome = f"ended {resp.status_code}"
        except requests.RequestException as exc:
            outcome = f"cut: {type(exc).__name__}"
        with self._lock:
            self.ended.append(outcome)

    def open(self, streams: int, whole: int) -> None:
        for stream in [True] * streams + [False] * whole:
            t = threading.Thread(target=self._one, args=(stream,), daemon=True)
            t.start()
            self.threads.append(t)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


def start(fleet: Fleet) -> None:
    fleet.start_serve("--settle", "1")
    wait_until(lambda: fleet.ready("slow"), "the local agent's replica of slow ready")


def router_inflight(fleet: Fleet) -> int:
    return sum(r["inflight"] for r in fleet.status()["replicas"])


def stops_within_grace(fleet: Fleet) -> None:
    proc = fleet.controller
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=SHUTDOWN_GRACE + EXIT_SLACK)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve still running {SHUTDOWN_GRACE + EXIT_SLACK:.0f} s after SIGTERM:\n"
                             + fleet.log("serve")[-3000:]) from None
    assert code == 0, fleet.log("serve")[-3000:]
    # Documented: serve stops its local agent's engines before it exits.
    wait_until(lambda: fleet.marked_pids() == [], "the local engines gone", timeout=30)


def test_sigterm_with_many_requests_in_flight_and_a_catalog_at_its_bounds(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "slow.yaml").write_text(SLOW)
    (fleet.catalogs / "bounds.yaml").write_text(at_bounds())
    try:
        start(fleet)
        wait_until(lambda: fleet.status()["passes"] > 3, "reconcile passes over the catalog at its bounds")
        assert all(m["unplaceable"] for m in fleet.status()["models"] if m["name"].startswith("big"))
        held = InFlight(fleet.router)
        held.open(streams=48, whole=16)
        wait_until(lambda: held.started >= 48 and router_inflight(fleet) >= 64, "64 requests in flight")
        assert requests.get(fleet.router + "/healthz", timeout=10).status_code == 200
        stops_within_grace(fleet)
        held.join(timeout=30)
        # The drain ran out for every one of them (500 s replies): each was cut by
        # the server, none left hanging on a process that is gone.
        assert len(held.ended) == 64 and all(e.startswith("cut") or e == "ended 200" for e in held.ended), held.ended
        assert "shutting down" in fleet.log("serve")
    finally:
        fleet.close()


def test_sigterm_while_the_watcher_loads_a_large_edit(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "slow.yaml").write_text(SLOW)
    try:
        start(fleet)
        # ~900,000 YAML nodes, under the node budget: a load of a few seconds,
        # on the watcher's thread, when SIGTERM arrives.
        big = fleet.catalogs / ".big.yaml.tmp"
        big.write_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels: []\nx-padding: ["
                       + ",".join(["1"] * 900_000) + "]\n")
        os.rename(big, fleet.catalogs / "big.yaml")
        stops_within_grace(fleet)
    finally:
        fleet.close()
