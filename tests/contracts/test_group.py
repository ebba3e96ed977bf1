"""GroupSlot from the wire: what a node reports of a member is bounded before the controller walks its ranks."""
from __future__ import annotations

import pytest

from llmgwctl.catalog.multinode import MAX_NODES
from llmgwctl.contracts import GroupSlot, ReplicaSpec
from llmgwctl.contracts.errors import ContractError
from llmgwctl.contracts.report import ReportedReplica

SLOT = {"group": "g", "rank": 1, "size": 2, "parallel": "pipeline", "head_host": "10.0.0.5", "port": 29500}


def test_a_slot_round_trips():
    slot = GroupSlot.from_dict(SLOT)
    assert GroupSlot.from_dict(slot.to_dict()) == slot and slot.member_id(1) == "g-r1" and not slot.head


@pytest.mark.parametrize("bad", [{"size": MAX_NODES + 1}, {"size": 10**9}, {"size": 1}, {"rank": 2},
                                 {"rank": -1}, {"port": 0}, {"port": 70000}, {"head_host": ""}, {"rpc_port": -1}])
def test_a_slot_out_of_range_is_refused(bad):
    with pytest.raises(ContractError, match="out of range"):
        GroupSlot.from_dict({**SLOT, **bad})


def test_a_report_with_a_spec_of_a_billion_members_carries_no_spec():
    spec = ReplicaSpec(id="g-r1", model="m", profile="p", engine="fake", source="m", gpus=1).to_dict()
    spec["group"] = {**SLOT, "size": 10**9}
    rep = ReportedReplica.from_dict({"id": "g-r1", "spec_hash": "x", "model": "m", "profile": "p", "engine": "fake",
                                     "gpu_indices": [0], "state": "ready", "spec": spec})
    assert rep.spec is None     # nothing to adopt: the controller never walks its ranks
