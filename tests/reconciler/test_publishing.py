"""Publishing as a part, and the incremental tripwire that wraps it: lists handed out only when they changed."""
from __future__ import annotations

import pytest

from llmgwctl.contracts import ReplicaState
from llmgwctl.reconciler.incremental import IncrementalMismatch, check_published, check_skipped_merges, checked
from llmgwctl.reconciler.publishing import Publisher

from .test_adoption_part import Part
from .test_records import CAT, rec


class ChangeSink:
    def __init__(self):
        self.changes = []

    def set_endpoints(self, endpoints):
        self.changes.append(("set", tuple(e.replica_id for e in endpoints)))

    def change_endpoints(self, endpoints, changed):
        self.changes.append(("change", {rid: ep is not None for rid, ep in changed.items()}))

    # The rest of the sink contract (contracts.RouterSink); these tests look at the endpoints.
    def set_model_states(self, states):
        pass

    def set_catalog(self, catalog):
        pass


def world():
    p = Part()
    r1 = rec("r1")
    p.report("n1", (r1, "ready"))
    p.records["r1"] = r1
    r1.reported, r1.state = p.inventory.get("n1").replicas["r1"], ReplicaState.READY
    sink = ChangeSink()
    pub = Publisher(p.records, p.inventory, p.desired)
    pub.add_sink(sink)
    return p, r1, pub, sink


def test_endpoints_are_pushed_as_changes_and_only_when_something_changed():
    p, r1, pub, sink = world()
    assert sink.changes == [("set", ())]
    pub.publish(CAT, settled=True)
    assert [e.replica_id for e in pub.endpoints] == ["r1"] and sink.changes[-1] == ("change", {"r1": True})
    assert p.desired.get("n1")[1] == (r1.spec,)
    version, pushes = pub.endpoints_version, len(sink.changes)
    pub.publish(CAT, settled=True)
    assert (pub.endpoints_version, len(sink.changes)) == (version, pushes), "nothing changed: nothing pushed"
    r1.state = ReplicaState.STOPPING
    pub.publish(CAT, settled=True)
    assert pub.endpoints == () and sink.changes[-1] == ("change", {"r1": False})
    assert p.desired.get("n1")[1] == (), "a stopping replica leaves its node's list"
    check_published(p.records, pub)


def test_before_settling_only_nodes_with_records_get_a_list():
    p, r1, pub, sink = world()
    p.report("n2")
    pub.publish(CAT, settled=False)
    assert p.desired.get("n1") is not None and p.desired.get("n2") is None
    pub.publish(CAT, settled=True)
    assert p.desired.get("n2")[1] == ()


def test_the_tripwire_finds_a_write_the_records_did_not_note():
    p, r1, pub, sink = world()
    with checked(p.records, p.adoption, pub):
        pub.publish(CAT, settled=True)
    object.__setattr__(r1, "state", ReplicaState.FAILED)     # past the records' notes: a bug's write
    with pytest.raises(IncrementalMismatch, match="kept endpoints differ"), checked(p.records, p.adoption, pub):
        pub.publish(CAT, settled=True)


def test_the_tripwire_finds_a_skipped_merge_whose_records_changed_unseen():
    p, r1, pub, sink = world()
    p.adoption.merge(CAT, p.clock.now, settled=True)
    check_skipped_merges(p.records, p.adoption)
    object.__setattr__(r1, "state", ReplicaState.FAILED)
    with pytest.raises(IncrementalMismatch, match="merge was skipped"):
        check_skipped_merges(p.records, p.adoption)


def test_no_check_after_a_publish_that_did_not_finish():
    p, r1, pub, sink = world()
    object.__setattr__(r1, "state", ReplicaState.FAILED)
    with pytest.raises(RuntimeError), checked(p.records, p.adoption, pub):
        raise RuntimeError("a pass that raised before publishing")
    assert pub.published == 0, "nothing was published, so nothing was compared"


def test_every_pass_of_the_suites_reconcilers_is_checked():
    """conftest sets CHECK_INCREMENTAL: a write past the records' notes fails the very next pass."""
    from llmgwctl.reconciler import core

    from .test_reconciler import World, catalog, converge, model

    assert core.CHECK_INCREMENTAL
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    converge(w)
    (r,) = w.rec.replicas.values()
    assert r.state == ReplicaState.READY and len(w.rec.endpoints) == 1
    object.__setattr__(r, "state", ReplicaState.FAILED)
    with pytest.raises(IncrementalMismatch):
        w.rec.reconcile_once()
