"""Scaling on its own: what each model wants from its floor, ceiling, idle timeout, wake and use."""
from __future__ import annotations

import pytest

from llmgwctl.contracts import ReplicaState
from llmgwctl.reconciler.records import Records
from llmgwctl.reconciler.scaling import Scaling

from .test_reconciler import catalog, model
from .test_records import rec

NOW = 1000.0

# (case, replicas, idle timeout, woken seconds ago, used seconds ago (a ready replica's last request), wanted)
CASES = [
    ("a floor is wanted", "2", None, None, None, 2),
    ("scale to zero, never used", "{min: 0, max: 3}", "10m", None, None, 0),
    ("scale to zero, woken", "{min: 0, max: 3}", "10m", 1.0, None, 1),
    ("scale to zero, used lately", "{min: 0, max: 3}", "10m", None, 5.0, 1),
    ("scale to zero, idle past its timeout", "{min: 0, max: 3}", "10m", None, 601.0, 0),
    ("woken long ago, idle since", "{min: 0, max: 3}", "10m", 900.0, None, 0),
    ("a floor holds however idle", "{min: 1, max: 3}", "10m", None, 9000.0, 1),
]


@pytest.mark.parametrize("case, replicas, idle, woken, used, want", CASES, ids=[c[0] for c in CASES])
def test_wanted(case, replicas, idle, woken, used, want):
    cat = catalog(model("a", replicas=replicas, idle=idle))
    events: list[tuple[str, str]] = []
    scaling = Scaling(lambda kind, msg: events.append((kind, msg)))
    records = Records()
    usage = {}
    if used is not None:
        r = records["r1"] = rec("r1")
        r.state = ReplicaState.READY
        usage["r1"] = (NOW - used, 0)
    if woken is not None:
        scaling.woken("a", NOW - woken)
    assert scaling.wanted(cat, NOW, usage, records) == {"a": want}
    assert scaling.wanted_of("a", 99) == want
    # A change from the floor it starts at is said once, as a scale event; the same answer again says nothing.
    said = len(events)
    assert said == (1 if want != cat.models[0].replicas.min else 0)
    assert scaling.wanted(cat, NOW, usage, records) == {"a": want} and len(events) == said


def test_a_model_gone_from_the_catalog_loses_its_scale():
    scaling = Scaling(lambda kind, msg: None)
    scaling.wanted(catalog(model("a"), model("b")), NOW, {}, Records())
    assert set(scaling.scales) == {"a", "b"}
    scaling.wanted(catalog(model("a")), NOW, {}, Records())
    assert set(scaling.scales) == {"a"}


def test_tally_sums_each_model_in_one_walk():
    scaling = Scaling(lambda kind, msg: None)
    records = Records()
    for rid, state in (("r1", ReplicaState.READY), ("r2", ReplicaState.STARTING), ("r3", ReplicaState.DRAINING),
                       ("r4", ReplicaState.PENDING)):
        records[rid] = rec(rid)
        records[rid].state = state
    # r3 is draining: its use does not keep the model awake.
    tally = scaling.tally(NOW, {"r1": (NOW - 50, 0), "r3": (NOW - 1, 3)}, records)["a"]
    assert tally.ready == ["r1"] and tally.starting == 2 and tally.last_used == NOW - 50
    assert tally.concurrency() is None, "no two counter readings yet"


def test_counters_are_differenced_between_two_readings():
    class Counters:
        busy = {"r1": 2.0}

        def inflight_seconds(self):
            return dict(self.busy)

    counters = Counters()
    scaling = Scaling(lambda kind, msg: None, concurrency=counters)
    records = Records()
    records["r1"] = rec("r1")
    records["r1"].state = ReplicaState.READY
    scaling.read(NOW)
    assert scaling.counters(NOW) is None
    counters.busy = {"r1": 8.0}
    scaling.read(NOW + 2)
    assert scaling.tally(NOW + 2, {}, records)["a"].concurrency() == (6.0, 2.0)


def test_cold_start_is_a_running_mean_of_placed_replicas():
    scaling = Scaling(lambda kind, msg: None)
    first, second = rec("r1"), rec("r2")
    scaling.timed_cold_start(first, 6.0)
    scaling.timed_cold_start(second, 10.0)
    assert first.timed and second.timed and scaling.scales["a"].cold_start == 8.0
