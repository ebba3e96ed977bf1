"""The request log (control.requestlog) and its record (contracts.requestlog): bounded, filtered, checked."""
from __future__ import annotations

import pytest

from llmgwctl.contracts import RequestRecord, UsageError
from llmgwctl.control.requestlog import MAX_REPORTED, QueryError, RequestLog


def rec(i, model="m", asked=None, status=200):
    return RequestRecord(at=float(i), id=f"req-{i:04d}", key="team", asked=asked or model, model=model, status=status,
                         ttft=0.1, duration=0.2, tokens_in=3, tokens_out=5, replica="r-1")


def test_the_ring_keeps_the_last_records_newest_first():
    log = RequestLog(capacity=5)
    for i in range(12):
        log.record(rec(i))
    assert len(log) == 5 and log.total == 12
    assert [r.id for r in log.query()] == [f"req-{i:04d}" for i in (11, 10, 9, 8, 7)]
    assert [r.id for r in log.query(limit=2)] == ["req-0011", "req-0010"]


def test_filters_by_model_asked_or_served_status_and_request_id():
    log = RequestLog()
    log.record(rec(1, model="qwen-7b", asked="qwen"))
    log.record(rec(2, model="llama", status=503))
    log.record(rec(3, model="", asked="nope", status=404))
    assert [r.id for r in log.query(model="qwen")] == ["req-0001"]
    assert [r.id for r in log.query(model="qwen-7b")] == ["req-0001"]
    assert [r.id for r in log.query(status="5xx")] == ["req-0002"]
    assert [r.id for r in log.query(status="error")] == ["req-0003", "req-0002"]
    assert [r.id for r in log.query(status="404")] == ["req-0003"]
    assert [r.id for r in log.query(request_id="req-0002")] == ["req-0002"]
    assert [r.id for r in log.query(request_id="req-000", status="200")] == ["req-0001"]
    with pytest.raises(QueryError, match="status must be"):
        log.query(status="bad")


def test_listeners_hear_every_record():
    log, heard = RequestLog(), []
    log.listeners.append(heard.append)
    log.record(rec(1))
    assert [r.id for r in heard] == ["req-0001"]


def test_a_record_round_trips_and_a_bad_one_is_refused_by_field():
    r = rec(7)
    assert RequestRecord.from_dict(r.to_dict()) == r
    with pytest.raises(UsageError, match="status"):
        RequestRecord.from_dict(r.to_dict() | {"status": 42})
    with pytest.raises(UsageError, match="ttft"):
        RequestRecord.from_dict(r.to_dict() | {"ttft": float("inf")})
    with pytest.raises(UsageError, match="tokens_out"):
        RequestRecord.from_dict(r.to_dict() | {"tokens_out": -1})
    long = RequestRecord.from_dict(r.to_dict() | {"error": "x" * 10_000, "id": "y" * 1000})
    assert len(long.error or "") <= 500 and len(long.id) <= 200


def test_a_routers_reported_records_are_checked_one_by_one_and_bounded():
    log = RequestLog()
    good = rec(1).to_dict()
    assert log.take_reported([good, {"id": 3}, "junk"]) == 2
    assert [r.id for r in log.query()] == ["req-0001"]
    assert log.take_reported("not a list") == 0
    assert log.take_reported([good] * (MAX_REPORTED + 5)) == 5
    assert log.total == 1 + MAX_REPORTED
