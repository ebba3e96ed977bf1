"""The contracts on their own: wire forms that must not drift, and the errors a bad payload gets."""
from __future__ import annotations

import json

import pytest

from llmgwctl.contracts import (
    AGENT_STATES,
    AgentReport,
    ContractError,
    Endpoint,
    EndpointError,
    Gpu,
    ReplicaSpec,
    ReplicaState,
    ReportedReplica,
    ReportError,
    Usage,
    UsageError,
    UsageReport,
)


def spec() -> ReplicaSpec:
    return ReplicaSpec(id="r-1", model="m", profile="p", engine="fake", source="m", gpus=1, gpu_indices=(0,))


def wire_replica(**over):
    doc = {"id": "r-1", "spec_hash": spec().spec_hash, "model": "m", "profile": "p", "engine": "fake",
           "gpu_indices": [0], "port": 20000, "pid": 42, "state": "ready", "restarts": 0, "last_exit": None,
           "last_log": [], "url": "http://127.0.0.1:20000", "reason": "", "spec": spec().to_dict()}
    doc.update(over)
    return doc


def wire_report(**over):
    # As an agent sends it since node identities (issue 13): instance_id and
    # previous_instance_id beside the machine's boot_id.
    doc = {"node": "n1", "instance_id": "i-2", "boot_id": "b", "previous_instance_id": "i-1",
           "agent_version": "0", "pools": ["l4"],
           "engines": {"fake": {"available": True, "reason": ""}, "vllm": {"available": False, "reason": "pip it"}},
           "gpus": [{"index": 0, "uuid": "GPU-0", "name": "L4-24GB", "memory_mib": 24576}],
           "replicas": [wire_replica()], "advertise_host": "127.0.0.1"}
    doc.update(over)
    return doc


def test_states_are_their_wire_strings_everywhere():
    ready = ReplicaState.READY
    assert ready == "ready" and str(ready) == "ready" and f"replica-{ready}" == "replica-ready"
    assert json.dumps({"state": ready}) == '{"state": "ready"}'
    assert {s.value for s in ReplicaState} == {"pending", "starting", "ready", "failed", "draining", "stopping",
                                               "lost"}
    assert {s.value for s in AGENT_STATES} == {"starting", "ready", "failed", "stopping"}


def test_a_report_round_trips_unchanged_on_the_wire():
    doc = wire_report()
    report = AgentReport.from_dict(doc, node="n1")
    assert report.to_dict() == doc
    assert report.gpus == (Gpu(0, "GPU-0", "L4-24GB", 24576),)
    ok, why = report.engines["vllm"]
    assert (ok, why) == (False, "pip it")
    rep = report.replicas[0]
    assert rep.state is ReplicaState.READY and rep.spec == spec() and rep.gpu_indices == (0,)


def test_a_report_says_which_agent_process_speaks_for_the_node():
    report = AgentReport.from_dict(wire_report(), node="n1")
    assert (report.instance_id, report.boot_id, report.previous_instance_id) == ("i-2", "b", "i-1")


def test_an_agent_before_instance_ids_is_known_by_its_per_start_boot_id():
    # Such an agent sent a boot_id new on every start: that is what an instance is.
    doc = wire_report()
    del doc["instance_id"], doc["previous_instance_id"]
    report = AgentReport.from_dict(doc, node="n1")
    assert (report.instance_id, report.previous_instance_id) == ("b", "")


def test_a_minimal_report_takes_the_defaults():
    report = AgentReport.from_dict({"node": "n1", "gpus": [{"index": 3}], "replicas": []}, node="n1")
    assert report.gpus == (Gpu(3),) and report.engines == {} and report.pools == ()


@pytest.mark.parametrize("doc, message", [
    ([], "must be a JSON object"),
    (wire_report(node="n2"), "report for node 'n2' sent to node 'n1'"),
    (wire_report(replicas=[wire_replica(state="draining")]), "state 'draining' is not one an agent reports"),
    (wire_report(replicas=[wire_replica(state="asleep")]), "state 'asleep'"),
    (wire_report(replicas=[wire_replica(id="")]), "id must be a non-empty string"),
    (wire_report(replicas=[wire_replica(), wire_replica()]), "replica 'r-1' twice"),
    (wire_report(replicas=[wire_replica(port="eighty")]), "replica r-1"),
    (wire_report(gpus=[{"uuid": "no index"}]), "malformed report"),
    (wire_report(gpus={"index": 0}), "'gpus' must be a list"),
    (wire_report(engines=["fake"]), "engines must be an object"),
])
def test_a_report_that_breaks_the_protocol_says_what(doc, message):
    with pytest.raises(ReportError, match=message) as caught:
        AgentReport.from_dict(doc, node="n1")
    assert isinstance(caught.value, ContractError) and isinstance(caught.value, ValueError)


def test_an_unreadable_spec_only_means_no_adoption():
    # The node must not look silent over one replica's spec: the replica is
    # reported, without a spec, and the reconciler does not adopt it.
    rep = ReportedReplica.from_dict(wire_replica(spec={"id": "r-1"}))
    assert rep.spec is None and rep.state is ReplicaState.READY


def test_usage_reports_travel_as_idle_seconds_and_land_on_the_receivers_clock():
    report = UsageReport.of("router-a", 7, {"r1": Usage(95.0, 2), "r2": Usage(None, 0)}, now=100.0)
    wire = report.to_dict()
    assert wire == {"router": "router-a", "version": 7,
                    "replicas": {"r1": {"idle_seconds": 5.0, "inflight": 2},
                                 "r2": {"idle_seconds": None, "inflight": 0}}}
    back = UsageReport.from_dict(json.loads(json.dumps(wire)))
    assert back.snapshot(now=1000.0) == {"r1": Usage(995.0, 2), "r2": Usage(None, 0)}
    last, inflight = back.snapshot(now=1000.0)["r1"]
    assert (last, inflight) == (995.0, 2)


def test_per_adapter_counters_travel_beside_the_replicas_and_an_old_report_has_none():
    report = UsageReport.of("router-a", 7, {"r1": Usage(95.0, 2)}, now=100.0, adapters={"sql": 12.34567})
    wire = report.to_dict()
    assert wire["adapters"] == {"sql": {"inflight_seconds": 12.346}}
    back = UsageReport.from_dict(json.loads(json.dumps(wire)))
    assert dict(back.adapters) == {"sql": 12.346}
    # A router from before the counters: no key on the wire, none read.
    old = UsageReport.of("router-a", 7, {"r1": Usage(95.0, 2)}, now=100.0)
    assert "adapters" not in old.to_dict() and dict(UsageReport.from_dict(old.to_dict()).adapters) == {}


@pytest.mark.parametrize("adapters", [[], {"sql": 3}, {"sql": {"inflight_seconds": -1}},
                                      {"sql": {"inflight_seconds": 1e308}}, {"x" * 129: {"inflight_seconds": 1}},
                                      {f"a{i}": {"inflight_seconds": 1} for i in range(16385)}])
def test_malformed_adapter_counters_are_usage_errors(adapters):
    with pytest.raises(UsageError, match="adapter"):
        UsageReport.from_dict({"router": "a", "replicas": {}, "adapters": adapters})


@pytest.mark.parametrize("body", [None, {"router": 1, "replicas": {}}, {"router": "a", "replicas": []},
                                  {"router": "a", "replicas": {"r": {"idle_seconds": -1}}},
                                  {"router": "a", "replicas": {"r": 3}},
                                  # Numbers past any real reading: sums of them overflowed the reconciler's pass.
                                  {"router": "a", "replicas": {"r": {"inflight": 1e400}}},
                                  {"router": "a", "replicas": {"r": {"inflight": 10 ** 300}}},
                                  {"router": "a", "replicas": {"r": {"idle_seconds": float("inf")}}},
                                  {"router": "a", "replicas": {"r": {"inflight_seconds": 1e308}}},
                                  {"router": "a", "replicas": {"r": {"inflight_seconds": float("nan")}}}])
def test_malformed_usage_reports_are_usage_errors(body):
    with pytest.raises(UsageError):
        UsageReport.from_dict(body)


@pytest.mark.parametrize("entry", [{"inflight": 1e400}, {"inflight": 10 ** 300}, {"inflight": -1}, {"inflight": "x"},
                                   {"idle_seconds": float("inf")}, {"idle_seconds": 10 ** 400},
                                   {"inflight_seconds": 1e308}, {"load": {"running": "a"}}, 7])
def test_a_bad_usage_entry_is_named_by_its_replica(entry):
    # A router's report carries thousands of entries: the 400 must say which one is wrong.
    body = {"router": "a", "replicas": {"ok": {"inflight": 1}, "replica-7": entry}}
    with pytest.raises(UsageError, match="for 'replica-7'"):
        UsageReport.from_dict(body)


def test_an_endpoint_error_names_the_endpoint_and_is_a_value_error():
    with pytest.raises(EndpointError, match="endpoint r1: url must look like") as caught:
        Endpoint(replica_id="r1", model="m", profile="p", engine="fake", url="127.0.0.1:8000")
    assert isinstance(caught.value, ValueError)
    with pytest.raises(EndpointError, match="missing field 'url'"):
        Endpoint.from_dict({"replica_id": "r1", "model": "m"})
