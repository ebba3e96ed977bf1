"""A router's usage reports count only as far as the engines' own readings show traffic.

A standalone router holds the agent token: it may report usage, which keeps
models awake and drains waiting, but it is not the operator. Here a "router"
that claims a million requests in flight on a real replica of a real `serve`
does not move the model off its minimum, reports that break the contract get
a 400 naming the field, and the board's arithmetic is checked directly:
claims capped by the engine's reading, shared by every router id, replicas
the controller does not know dropped.
"""
from __future__ import annotations

import json
import time

import pytest
import requests

from llmgwctl.contracts import LoadReading, UsageError
from llmgwctl.control.usage import BURST, IN_TRANSIT, UNREAD_INFLIGHT, TooManyRouters, UsageBoard
from tests.e2e.fleet import Fleet, wait_until
from tests.support import FakeClock

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: scaled
    replicas: {min: 1, max: 3}
    autoscale: {metric: inflight, target: 2, scale_down_window: 30s}
    profiles:
      - {name: cpu, engine: fake, gpus: 0}
"""
# Seconds the hostile router keeps reporting: several of the autoscaler's
# averaging windows and reconciler passes, enough for the fast path to act.
CLAIMING = 10.0


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1")
        yield fleet
    finally:
        fleet.close()


def usage(fleet: Fleet, body) -> requests.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return requests.post(fleet.control + "/api/v1/usage", data=data, timeout=10,
                         headers={"Content-Type": "application/json"})


def model(fleet: Fleet) -> dict:
    return next(m for m in fleet.status()["models"] if m["name"] == "scaled")


def test_a_router_claiming_a_million_in_flight_does_not_scale_the_model(fleet):
    wait_until(lambda: fleet.ready("scaled"), "the replica ready")
    (replica,) = fleet.ready("scaled")
    version = requests.get(fleet.control + "/api/v1/watch/endpoints?timeout=0", timeout=10).json()["version"]
    start = time.monotonic()
    desired, inflight = [], []
    while time.monotonic() - start < CLAIMING:
        elapsed = time.monotonic() - start
        resp = usage(fleet, {"router": "hostile", "version": version, "replicas": {
            replica["id"]: {"idle_seconds": 0, "inflight": 1e6, "inflight_seconds": 1e6 * elapsed,
                            "load": {"running": 1e6, "waiting": 1e6, "kv_cache": 1.0}},
            "r-made-up": {"idle_seconds": 0, "inflight": 1e6, "inflight_seconds": 1e6 * elapsed}}})
        assert resp.status_code == 204, resp.text[:300]
        status = fleet.status()
        desired.append(next(m["desired"] for m in status["models"] if m["name"] == "scaled"))
        inflight.append(next(r["inflight"] for r in status["replicas"] if r["id"] == replica["id"]))
        time.sleep(0.5)
    assert set(desired) == {1}, f"the claims scaled the model: desired went {desired}"
    # Counted as busy (a drain would wait for it), never as a million.
    assert max(inflight) <= IN_TRANSIT, inflight
    status = fleet.status()
    assert status["routers"] == 1
    assert not [e for e in status["events"] if e["kind"] == "scale-up"], status["events"][-5:]
    assert all(r["id"] != "r-made-up" for r in status["replicas"])
    assert fleet.chat("scaled").status_code == 200, "the replica serves on"


@pytest.mark.parametrize("body, field", [
    ({"router": "r", "version": 1, "replicas": {"x": {"inflight": -1}}}, "inflight"),
    ('{"router": "r", "version": 1, "replicas": {"x": {"inflight": NaN}}}', "inflight"),
    ('{"router": "r", "version": 1, "replicas": {"x": {"inflight": 1, "inflight_seconds": Infinity}}}',
     "inflight_seconds"),
    ({"router": "r", "version": 1, "replicas": {"x": {"idle_seconds": 1e300}}}, "idle_seconds"),
    ({"router": "r", "version": 1, "replicas": {"x": {"inflight": 1, "load": {"running": 1e300, "waiting": 0}}}},
     "load.running"),
    ({"router": "r", "version": "5", "replicas": {}}, "version"),
    ({"router": "r", "version": 10**30, "replicas": {}}, "version"),
    ({"router": "r" * 1000, "version": 1, "replicas": {}}, "router"),
    ({"router": "r\x1b[2J", "version": 1, "replicas": {}}, "router"),
    ({"router": "r", "version": 1, "replicas": {"y" * 1000: {"inflight": 1}}}, "replica id"),
    ({"router": "r", "version": 1, "replicas": {f"r-{i}": {} for i in range(70000)}}, "replicas"),
    ({"router": "r", "version": 1, "replicas": []}, "replicas"),
    ("[1, 2", "JSON"),
])
def test_a_report_breaking_the_contract_is_a_400_naming_the_field(fleet, body, field):
    resp = usage(fleet, body)
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    message = resp.json()["error"]["message"]
    assert field in message, message
    assert requests.get(fleet.control + "/healthz", timeout=5).ok
    assert fleet.status()["routers"] == 0, "nothing of a refused report is kept"


# --- the board's arithmetic, with a local router of known readings --------------------------------

class Local:
    """The in-process router as the board reads it: usage, its own counters, and the engines' readings."""

    def __init__(self):
        self.usage: dict = {}
        self.busy: dict = {}
        self.readings: dict = {}

    def usage_snapshot(self):
        return dict(self.usage)

    def inflight_seconds(self):
        return dict(self.busy)

    def load_snapshot(self):
        return dict(self.readings)


def claim(board, router, rid, inflight, counter):
    board.report({"router": router, "version": 1,
                  "replicas": {rid: {"idle_seconds": 0, "inflight": inflight, "inflight_seconds": counter}}})


def test_claims_count_up_to_what_the_engine_runs_less_the_local_routers_own():
    clock = FakeClock(100.0)
    local = Local()
    local.readings = {"a": LoadReading(running=3, waiting=1)}
    local.usage = {"a": (99.0, 1)}
    board = UsageBoard(local, version=lambda: 1, clock=clock)
    claim(board, "s", "a", 1e6, 0.0)
    assert board.usage_snapshot()["a"].inflight == 1 + (3 + 1 - 1 + IN_TRANSIT)
    board.inflight_seconds()
    for step in range(1, 6):
        clock.advance(2)
        claim(board, "s", "a", 1e6, 2e6 * step)
        board.inflight_seconds()
    # Ten seconds of claims counted at the ceiling's rate (4 a second), plus at most one burst.
    assert board.inflight_seconds()["a"] <= (3 + 1 - 1 + IN_TRANSIT) * (10 + BURST)


def test_many_router_ids_share_one_ceiling():
    clock = FakeClock(100.0)
    local = Local()
    local.readings = {"a": LoadReading(running=2, waiting=0)}
    board = UsageBoard(local, version=lambda: 1, clock=clock)
    routers = [f"s{i}" for i in range(50)]
    for r in routers:
        claim(board, r, "a", 1e6, 0.0)
    assert board.usage_snapshot()["a"].inflight == 2 + IN_TRANSIT
    board.inflight_seconds()
    for step in range(1, 6):
        clock.advance(2)
        for r in routers:
            claim(board, r, "a", 1e6, 2e6 * step)
        board.inflight_seconds()
    assert board.inflight_seconds()["a"] <= (2 + IN_TRANSIT) * (10 + BURST)


def test_honest_routers_under_the_ceiling_count_whole():
    clock = FakeClock(100.0)
    local = Local()
    local.readings = {"a": LoadReading(running=6, waiting=0)}
    board = UsageBoard(local, version=lambda: 1, clock=clock)
    for r in ("s1", "s2", "s3"):
        claim(board, r, "a", 2, 0.0)
    board.inflight_seconds()
    for step in range(1, 6):
        clock.advance(1)
        board.inflight_seconds()        # the reconciler reads every pass, between the routers' reports
        clock.advance(1)
        for r in ("s1", "s2", "s3"):
            claim(board, r, "a", 2, 4.0 * step)
        board.inflight_seconds()
    assert board.inflight_seconds()["a"] == pytest.approx(3 * 4.0 * 5)
    assert board.usage_snapshot()["a"].inflight == 6


def test_an_unread_replica_counts_as_busy_and_no_more_and_relayed_gauges_are_not_taken():
    clock = FakeClock(100.0)
    local = Local()
    board = UsageBoard(local, version=lambda: 1, clock=clock)
    board.report({"router": "s", "version": 1, "replicas": {"a": {
        "idle_seconds": 0, "inflight": 50, "inflight_seconds": 0.0,
        "load": {"running": 50, "waiting": 1e6, "kv_cache": 1.0}}}})
    assert board.usage_snapshot()["a"].inflight == UNREAD_INFLIGHT
    assert board.load_snapshot() == {}, "the controller reads engines itself; a relayed reading is not taken"
    board.inflight_seconds()
    clock.advance(2)
    claim(board, "s", "a", 50, 100.0)
    assert board.inflight_seconds()["a"] <= UNREAD_INFLIGHT * BURST


def test_replicas_the_controller_does_not_know_are_dropped():
    known = {"a"}
    board = UsageBoard(Local(), version=lambda: 1, clock=FakeClock(100.0), known=known.__contains__)
    board.report({"router": "s", "version": 1, "replicas": {"a": {"idle_seconds": 1, "inflight": 0},
                                                            "ghost": {"idle_seconds": 0, "inflight": 9}}})
    assert set(board.usage_snapshot()) == {"a"}
    assert "ghost" not in board.inflight_seconds()


def test_the_routers_heard_at_once_are_bounded():
    clock = FakeClock(100.0)
    board = UsageBoard(version=lambda: 1, clock=clock, max_routers=3)
    for r in ("s1", "s2", "s3"):
        board.report({"router": r, "version": 1, "replicas": {}})
    with pytest.raises(TooManyRouters):
        board.report({"router": "s4", "version": 1, "replicas": {}})
    board.report({"router": "s1", "version": 1, "replicas": {}})   # one already heard is heard again
    clock.advance(7)                                                # all silent: forgotten
    board.report({"router": "s4", "version": 1, "replicas": {}})
    assert board.routers() == 1


def test_the_contract_names_the_field():
    from llmgwctl.contracts import UsageReport
    with pytest.raises(UsageError, match=r"for 'x' in replicas: inflight"):
        UsageReport.from_dict({"router": "r", "version": 1, "replicas": {"x": {"inflight": 1e7}}})
