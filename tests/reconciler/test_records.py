"""Records: every way to change them is noted, by id and by node, and the per-node index follows."""
from __future__ import annotations

import pytest

from llmgwctl.contracts import ReplicaSpec, ReplicaState
from llmgwctl.reconciler.records import PUBLISHED, Records, Replica

from .test_reconciler import catalog, model

CAT = catalog(model("a"))


def rec(rid: str, node: str = "n1") -> Replica:
    m = CAT.models[0]
    p = m.profiles[0]
    return Replica(spec=ReplicaSpec.for_profile(rid, m, p, CAT.engines[p.engine], (0,)), node=node, created=0.0)


def filled() -> tuple[Records, dict[str, Replica]]:
    records = Records()
    mine = {"r1": rec("r1", "n1"), "r2": rec("r2", "n2")}
    for rid, r in mine.items():
        records[rid] = r
    records.changed_ids.clear()
    records.changed_nodes.clear()
    records.unmerged.clear()
    return records, mine


# (what is done, the ids and nodes it must note)
WRITES = [
    ("set a new id", lambda rs, m: rs.__setitem__("r3", rec("r3", "n3")), {"r3"}, {"n3"}),
    ("replace on another node", lambda rs, m: rs.__setitem__("r1", rec("r1", "n9")), {"r1"}, {"n1", "n9"}),
    ("delete", lambda rs, m: rs.__delitem__("r1"), {"r1"}, {"n1"}),
    ("pop", lambda rs, m: rs.pop("r2"), {"r2"}, {"n2"}),
    ("popitem", lambda rs, m: rs.popitem(), {"r1"}, {"n1"}),
    ("clear", lambda rs, m: rs.clear(), {"r1", "r2"}, {"n1", "n2"}),
    ("update", lambda rs, m: rs.update({"r4": rec("r4", "n4")}), {"r4"}, {"n4"}),
    ("update by keywords", lambda rs, m: rs.update(r5=rec("r5", "n1")), {"r5"}, {"n1"}),
    ("setdefault of a new id", lambda rs, m: rs.setdefault("r6", rec("r6", "n2")), {"r6"}, {"n2"}),
    ("setdefault of a kept id", lambda rs, m: rs.setdefault("r1", rec("r1", "n7")), set(), set()),
    ("a record's state", lambda rs, m: setattr(m["r1"], "state", ReplicaState.READY), {"r1"}, {"n1"}),
    ("a record's report", lambda rs, m: setattr(m["r2"], "reported", None), {"r2"}, {"n2"}),
    ("a field no pass compares", lambda rs, m: setattr(m["r1"], "drain_reason", "x"), set(), set()),
]


@pytest.mark.parametrize("what, write, ids, nodes", WRITES, ids=[w[0] for w in WRITES])
def test_every_write_is_noted(what, write, ids, nodes):
    records, mine = filled()
    write(records, mine)
    assert records.changed_ids == ids
    assert records.changed_nodes == nodes and records.unmerged == nodes
    # The per-node index is the records, grouped, in record order.
    grouped: dict[str, dict[str, Replica]] = {}
    for rid, r in records.items():
        grouped.setdefault(r.node, {})[rid] = r
    assert records.on_node == grouped


def test_a_record_taken_out_is_no_longer_watched():
    records, mine = filled()
    gone = records.pop("r1")
    records.changed_ids.clear()
    gone.state = ReplicaState.FAILED
    assert records.changed_ids == set(), "a record outside the records tells nobody"
    replaced = mine["r2"]
    records["r2"] = rec("r2", "n2")
    records.changed_ids.clear()
    replaced.state = ReplicaState.FAILED
    assert records.changed_ids == set(), "nor does one replaced under its id"


def test_reads_are_the_dicts():
    records, mine = filled()
    assert list(records) == ["r1", "r2"] and len(records) == 2 and "r1" in records
    assert records.get("nope") is None and records.get("r1") is mine["r1"]
    assert list(records.values()) == [mine["r1"], mine["r2"]] and records == mine
    assert records.of("n1") == [("r1", mine["r1"])] and records.of("n5") == []
    assert {"state", "reported", "spec"} == PUBLISHED   # spec: its adapters (reconciler.adapters)
