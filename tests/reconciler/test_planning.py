"""Planning as a part: a plan carried out on the records, its last plan taken again, drains, and its helpers."""
from __future__ import annotations

import pytest

from llmgwctl.contracts import ReplicaState
from llmgwctl.reconciler import planning
from llmgwctl.reconciler.placement_input import PlacementInput, SpecHashes, profile_of
from llmgwctl.reconciler.planning import Planner, memory_share, new_id
from llmgwctl.reconciler.records import Records

from .test_adoption_part import Part
from .test_reconciler import catalog, model
from .test_records import CAT, rec


@pytest.mark.parametrize("need, memory, indices, share", [
    (None, {0: (1000, 1000)}, (0,), None),            # whole GPUs
    (500, {0: (1000, 1000)}, (), None),                # no GPU
    (500, {0: (1000, 1000), 1: (2000, 0)}, (0, 1), 0.5),   # the smallest GPU's
    (500, {0: (0, 0)}, (0,), None),                    # unknown memory is never shared
    (5000, {0: (1000, 1000)}, (0,), 1.0),
])
def test_memory_share(need, memory, indices, share):
    assert memory_share(need, memory, indices) == share


@pytest.mark.parametrize("model, prefix", [("Llama 3.1/8B", "llama-3-1-8b-"), ("---", "replica-"), ("a" * 40, "a" * 24 + "-")])
def test_new_ids_are_slugs_with_random_bits(model, prefix):
    a, b = new_id(model), new_id(model)
    assert a.startswith(prefix) and b.startswith(prefix) and a != b and len(a) == len(prefix) + 8


def test_profile_of():
    m = CAT.models[0]
    assert profile_of(m, "p") is m.profiles[0] and profile_of(m, "q") is None and profile_of(None, "p") is None


def test_a_plan_places_then_the_same_input_takes_the_last_plan_again(monkeypatch):
    calls = []
    real = planning.place
    monkeypatch.setattr(planning, "place", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    p = Part()
    p.report("n1")
    events = []
    planner = Planner(p.records, lambda kind, msg: events.append(kind), move_every=300, drain_grace=30)
    build = PlacementInput(p.records, p.inventory, {}, SpecHashes()).build
    cat = catalog(model("a", replicas=2))
    planner.plan(cat, 0.0, {"a": 2}, *build(cat))
    assert len(p.records) == 2 and events == ["replica-placed", "replica-placed"] and len(calls) == 1
    running, views = build(cat)
    planner.plan(cat, 1.0, {"a": 2}, running, views)
    planner.plan(cat, 2.0, {"a": 2}, running, views)
    assert len(calls) == 2, "records changed once (two placed); the input after is the same: no call"
    planner.plan(cat, 3.0, {"a": 1}, *build(cat))
    assert sorted(r.state for r in p.records.values()) == [ReplicaState.DRAINING, ReplicaState.PENDING]


def test_unplaceable_is_said_once_per_reason():
    p = Part()
    events = []
    planner = Planner(p.records, lambda kind, msg: events.append(kind), move_every=300, drain_grace=30)
    build = PlacementInput(p.records, p.inventory, {}, SpecHashes()).build
    for t in (0.0, 1.0):
        planner.plan(CAT, t, {"a": 1}, *build(CAT))
    assert events == ["unplaceable"] and set(planner.unplaceable) == {"a"} and "a" in planner.unplaceable_detail


@pytest.mark.parametrize("inflight, waited, stops", [(0, 0.0, True), (2, 10.0, False), (2, 30.0, True)])
def test_drain(inflight, waited, stops):
    records = Records()
    r = records["r1"] = rec("r1")
    r.state, r.drain_since = ReplicaState.DRAINING, 100.0
    Planner(records, lambda k, m: None, move_every=300, drain_grace=30).drain(100.0 + waited, {"r1": (None, inflight)})
    assert r.state == (ReplicaState.STOPPING if stops else ReplicaState.DRAINING)


def test_placement_input_is_kept_until_what_it_was_built_from_changes():
    p = Part()
    p.report("n1")
    records = p.records
    records["r1"] = rec("r1")
    part = PlacementInput(records, p.inventory, {}, SpecHashes())
    running, views = part.build(CAT)
    again, views_again = part.build(CAT)
    assert running[0] is again[0] and views[0] is views_again[0]
    records["r1"].state = ReplicaState.READY
    part.cordoned.add("n1")
    changed, changed_views = part.build(CAT)
    assert changed[0] is not running[0] and changed[0].ready
    assert changed_views[0] is not views[0] and not changed_views[0].schedulable
    assert part.expected_hashes(CAT)[("a", "p")] == records["r1"].spec_hash
