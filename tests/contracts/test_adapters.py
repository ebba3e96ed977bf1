"""Adapters in the contracts: outside the spec hash, through every wire form (desired list, report, endpoint)."""
import dataclasses

import pytest

from llmgwctl.contracts import (
    AdapterSpec,
    AdapterStatus,
    Endpoint,
    EndpointError,
    ReplicaSpec,
    ReplicaState,
    ReportedReplica,
)

SPEC = ReplicaSpec(id="r1", model="base", profile="p", engine="vllm", source="org/base", gpus=1)


def test_adapters_leave_the_hash_alone_and_lora_slots_change_it_only_when_set():
    placed = dataclasses.replace(SPEC, adapters=(AdapterSpec("a", "/srv/a"),))
    assert placed.spec_hash == SPEC.spec_hash
    lora = dataclasses.replace(SPEC, lora_slots=4, lora_rank=16)
    assert lora.spec_hash != SPEC.spec_hash
    # A spec without LoRA keeps the hash it had before the fields: adopted after an upgrade.
    assert "lora_slots" not in SPEC.to_dict() and "adapters" not in SPEC.to_dict()
    back = ReplicaSpec.from_dict(dataclasses.replace(lora, adapters=placed.adapters).to_dict())
    assert back.adapters == placed.adapters and (back.lora_slots, back.lora_rank) == (4, 16)
    assert back.spec_hash == lora.spec_hash


def test_a_report_carries_each_adapters_state_and_the_loaded_ones():
    rep = ReportedReplica(id="r1", spec_hash="h", model="base", profile="p", engine="vllm", gpu_indices=(0,),
                          state=ReplicaState.READY, adapters=(AdapterStatus("a", "loaded"),
                                                              AdapterStatus("b", "failed", "engine answered 400: no")))
    back = ReportedReplica.from_dict(rep.to_dict())
    assert back == rep and back.loaded() == frozenset({"a"})
    with pytest.raises(Exception, match="state"):
        ReportedReplica.from_dict({**rep.to_dict(), "adapters": [{"name": "a", "state": "dancing"}]})


def test_an_endpoint_lists_its_adapters_on_the_wire_and_refuses_a_bad_list():
    ep = Endpoint("r1", "base", "p", "vllm", "http://10.0.0.1:8000", adapters=frozenset({"a", "b"}))
    assert ep.to_dict()["adapters"] == ["a", "b"] and Endpoint.from_dict(ep.to_dict()) == ep
    assert "adapters" not in dataclasses.replace(ep, adapters=frozenset()).to_dict()
    with pytest.raises(EndpointError):
        Endpoint.from_dict({**ep.to_dict(), "adapters": "a"})
