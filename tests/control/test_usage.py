import pytest

from llmgwctl.contracts import UsageError
from llmgwctl.control.usage import UsageBoard

from ..support import FakeClock


class Local:
    def __init__(self, snapshot):
        self.snapshot = snapshot

    def usage_snapshot(self):
        return self.snapshot


def test_local_and_remote_usage_merge_latest_use_and_summed_inflight():
    clock = FakeClock(100.0)
    board = UsageBoard(Local({"r1": (90.0, 1), "r2": (None, 0)}), version=lambda: 5, clock=clock)
    board.report({"router": "a", "version": 5, "replicas": {"r1": {"idle_seconds": 2, "inflight": 2},
                                                            "r3": {"idle_seconds": None, "inflight": 0}}})
    assert board.usage_snapshot() == {"r1": (98.0, 3), "r2": (None, 0), "r3": (None, 0)}
    assert board.routers() == 1


def test_a_silent_router_is_forgotten():
    clock = FakeClock(100.0)
    board = UsageBoard(version=lambda: 1, clock=clock)
    board.report({"router": "a", "version": 1, "replicas": {"r1": {"idle_seconds": 0, "inflight": 4}}})
    clock.now += 7
    assert board.usage_snapshot() == {} and board.routers() == 0


def test_a_router_behind_on_the_endpoint_list_keeps_its_replicas_busy():
    # It may still route to a replica the controller just withdrew: its "0 in
    # flight" must not end that replica's drain.
    clock = FakeClock(100.0)
    version = [7]
    board = UsageBoard(version=lambda: version[0], clock=clock)
    board.report({"router": "a", "version": 6, "replicas": {"r1": {"idle_seconds": 5, "inflight": 0}}})
    assert board.usage_snapshot()["r1"][1] == 1
    board.report({"router": "a", "version": 7, "replicas": {}})
    assert board.usage_snapshot() == {}


@pytest.mark.parametrize("body", [None, [], {"router": 1, "replicas": {}}, {"router": "a", "replicas": []},
                                  {"router": "a", "replicas": {"r": {"inflight": -1}}},
                                  {"router": "a", "replicas": {"r": {"inflight": "x"}}},
                                  {"router": "a", "replicas": {"r": 3}}])
def test_malformed_reports_are_refused_and_change_nothing(body):
    board = UsageBoard(version=lambda: 1)
    board.report({"router": "ok", "version": 1, "replicas": {"r": {"idle_seconds": 1, "inflight": 1}}})
    before = board.usage_snapshot()
    with pytest.raises(UsageError):
        board.report(body)
    assert board.usage_snapshot() == before


class LocalAdapters(Local):
    def __init__(self, counters):
        super().__init__({})
        self.counters = counters

    def adapter_inflight_seconds(self):
        return dict(self.counters)


def _adapter_report(board, router, replica_seconds, adapters):
    board.report({"router": router, "version": 1,
                  "replicas": {"r1": {"idle_seconds": 0, "inflight": 1, "inflight_seconds": replica_seconds}},
                  "adapters": {name: {"inflight_seconds": b} for name, b in adapters.items()}})


def test_adapter_counters_add_up_what_each_router_grew_by_and_only_the_catalogs_names_count():
    clock = FakeClock(100.0)
    board = UsageBoard(LocalAdapters({"sql": 10.0, "gone": 3.0}), version=lambda: 1, clock=clock,
                       known_adapter=lambda name: name in ("sql", "bot"))
    _adapter_report(board, "a", 50.0, {"sql": 500.0, "made-up": 1e6})
    assert board.adapter_inflight_seconds() == {"sql": 10.0}        # a first report is where it starts from
    clock.now += 2
    _adapter_report(board, "a", 58.0, {"sql": 506.0, "made-up": 2e6, "bot": 1.0})
    assert board.adapter_inflight_seconds() == {"sql": 16.0}
    assert "made-up" not in board._adapter_busy and "made-up" not in board._adapter_counted["a"]


def test_a_routers_adapter_claims_count_up_to_what_its_replicas_grew_by():
    clock = FakeClock(100.0)
    board = UsageBoard(version=lambda: 1, clock=clock, known_adapter=lambda name: True)
    _adapter_report(board, "a", 0.0, {"x": 0.0, "y": 0.0})
    clock.now += 2
    # 4 request-seconds on its replicas, 40 claimed for its adapters: scaled to the 4.
    _adapter_report(board, "a", 4.0, {"x": 30.0, "y": 10.0})
    assert board.adapter_inflight_seconds() == pytest.approx({"x": 3.0, "y": 1.0})


def test_a_report_without_adapters_moves_no_adapter_counter():
    clock = FakeClock(100.0)
    board = UsageBoard(version=lambda: 1, clock=clock, known_adapter=lambda name: True)
    for _ in range(3):
        board.report({"router": "old", "version": 1, "replicas": {"r1": {"idle_seconds": 0, "inflight": 5}}})
        clock.now += 2
    assert board.adapter_inflight_seconds() == {}
