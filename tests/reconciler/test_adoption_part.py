"""Adoption as a part: reports merged into the records, merges skipped only when nothing changed, lost nodes, trims."""
from __future__ import annotations

from llmgwctl.contracts import ReplicaState
from llmgwctl.inventory import Inventory
from llmgwctl.reconciler import DesiredStore
from llmgwctl.reconciler.adoption import Adoption
from llmgwctl.reconciler.placement_input import SpecHashes
from llmgwctl.reconciler.records import Records
from llmgwctl.reconciler.scaling import Scaling

from ..support import FakeClock
from .test_reconciler import run_report
from .test_records import CAT, rec


class Part:
    def __init__(self):
        self.clock = FakeClock()
        self.inventory = Inventory(clock=self.clock, unreachable_after=15)
        self.records = Records()
        self.events: list[tuple[str, str]] = []
        self.desired = DesiredStore()
        self.adoption = Adoption(self.records, self.inventory, self.desired,
                                 Scaling(lambda k, m: None), SpecHashes(),
                                 lambda kind, msg: self.events.append((kind, msg)), replace_after=60)

    def report(self, node, *replicas):
        self.inventory.report(node, {
            "node": node, "pools": ["gpu"], "engines": {"fake": {"available": True, "reason": ""}},
            "gpus": [{"index": i, "uuid": f"{node}-{i}", "name": "A100"} for i in range(2)],
            "replicas": [run_report(r.spec, state, port=20000 + i) for i, (r, state) in enumerate(replicas)]})

    def kinds(self):
        return [k for k, _ in self.events]


def test_a_merge_takes_the_report_and_is_skipped_while_nothing_changed():
    p = Part()
    r = p.records["r1"] = rec("r1")
    p.report("n1", (r, "ready"))
    p.adoption.merge(CAT, p.clock.now, settled=True)
    assert r.state == ReplicaState.READY and r.seen and p.kinds() == ["replica-ready"]
    assert [name for name, _ in p.adoption.skippable()] == ["n1"], "the next merge of n1 would change nothing"
    assert p.desired.get("n1") is not None, "a settled controller answers every node it merged"
    r.state = ReplicaState.FAILED       # noted by the records: n1 is merged again
    assert list(p.adoption.skippable()) == []
    p.adoption.merge(CAT, p.clock.now, settled=True)
    assert r.state == ReplicaState.READY, "the report says ready"


def test_a_replica_no_longer_reported_is_gone_and_one_told_to_stop_is_stopped():
    p = Part()
    a, b = rec("a1"), rec("b1")
    p.records.update(a1=a, b1=b)
    p.report("n1", (a, "ready"), (b, "ready"))
    p.adoption.merge(CAT, p.clock.now, settled=True)
    b.state = ReplicaState.STOPPING
    p.report("n1")
    p.adoption.merge(CAT, p.clock.now, settled=True)
    assert dict(p.records) == {}
    assert p.kinds()[-2:] == ["replica-gone", "replica-stopped"]


def test_after_the_window_only_a_replica_given_up_on_the_same_node_is_adopted_again():
    p = Part()
    r = rec("r1")
    p.report("n1", (r, "ready"))
    p.adoption.merge(CAT, p.clock.now, settled=True)
    assert "r1" not in p.records and p.kinds() == ["replica-refused"]
    p.adoption.forgotten["r1"] = "n2"
    p.adoption.merge(CAT, p.clock.now, settled=True)      # the same report: refused once, said once
    assert "r1" not in p.records and p.kinds() == ["replica-refused"]
    p.adoption.forgotten["r1"] = "n1"
    p.report("n1", (r, "ready"))
    p.adoption.merge(CAT, p.clock.now, settled=True)
    assert p.records["r1"].adopted and p.kinds()[-1] == "replica-readopted" and "r1" not in p.adoption.forgotten


def test_a_lost_nodes_replica_is_given_up_at_once_when_nothing_else_serves_its_model():
    p = Part()
    r = p.records["r1"] = rec("r1")
    p.report("n1", (r, "ready"))
    p.adoption.merge(CAT, p.clock.now, settled=True)
    p.clock.now += 20
    p.inventory.check()
    p.adoption.lost_nodes(p.clock.now)
    assert "r1" not in p.records and p.adoption.forgotten == {"r1": "n1"}
    assert p.kinds()[-1] == "replica-replaced"


def test_trim_keeps_the_replica_ready_longest():
    p = Part()
    old, new = rec("r1"), rec("r2")
    p.records.update(r1=old, r2=new)
    for r, since in ((old, 1.0), (new, 5.0)):
        r.state, r.ready_since, r.adopted = ReplicaState.READY, since, True
    p.adoption.adopted_models.add("a")
    p.adoption.trim(CAT, {"a": 1}, p.clock.now)
    assert (old.state, new.state) == (ReplicaState.READY, ReplicaState.DRAINING)
    assert "surplus of what was adopted" in new.drain_reason and p.adoption.adopted_models == set()
