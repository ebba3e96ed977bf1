"""An agent report's schema check, item by item (issue 19): the same problems as checking it whole.

The check of a changed report remembers the GPUs and replicas that passed,
so only what is new is checked again; a remembered item must never let an
invalid one through, and the problems named must be those of the schema
applied to the whole document.
"""
from __future__ import annotations

import copy

from llmgwctl.control import schemas


def report():
    replica = {"id": "r1", "spec_hash": "h", "model": "m", "profile": "p", "engine": "fake", "gpu_indices": [0],
               "port": 20001, "pid": 7, "state": "ready", "restarts": 0, "url": "http://127.0.0.1:20001"}
    return {"node": "n1", "instance_id": "i", "pools": ["gpu"], "engines": {"fake": {"available": True}},
            "gpus": [{"index": i, "uuid": f"g{i}", "name": "A100", "memory_mib": 81920} for i in range(2)],
            "replicas": [replica, dict(replica, id="r2", gpu_indices=[1], port=20002)]}


def whole(document):
    return schemas._problems(schemas.validator("agent-report"), document, 5)


def test_problems_are_those_of_the_whole_schema_and_a_remembered_item_lets_no_invalid_one_through():
    good = report()
    assert schemas.problems("agent-report", good) == [] == whole(good)
    breakages = [
        lambda d: d["replicas"][1].update(state="weird"),
        lambda d: d["replicas"][0].pop("spec_hash"),
        lambda d: d["gpus"][1].update(index=-1),
        lambda d: d.update(pools=3, node=""),
        lambda d: d.update(replicas={"r1": {}}),           # not an array: checked whole
        lambda d: d["replicas"].append("not an object"),
    ]
    for breaks in breakages:
        bad = copy.deepcopy(good)
        breaks(bad)
        found = schemas.problems("agent-report", bad)
        assert found and found == whole(bad)
    # The good items stay remembered; the same replica with one field broken is still checked.
    again = copy.deepcopy(good)
    again["replicas"][0]["restarts"] = -1
    assert schemas.problems("agent-report", again) == ["replicas[0].restarts: -1 is less than the minimum of 0"]


def test_past_its_bound_the_memory_starts_again_and_still_checks(monkeypatch):
    monkeypatch.setattr(schemas, "PASSED_ITEMS", 3)
    for n in range(5):
        doc = report()
        for r in doc["replicas"]:
            r["id"] += f"-{n}"
        assert schemas.problems("agent-report", doc) == []
        assert len(schemas._passed) <= 3
    doc["replicas"][0]["state"] = "weird"
    assert schemas.problems("agent-report", doc) == whole(doc) != []
