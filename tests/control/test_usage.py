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
