"""Status rows kept between reads (issue 19): a read after a change shows it, a read without one builds nothing.

Driven through the real reconciler, inventory and metrics collector with a
fake clock; "built" is the row cache's own count of rows it made, so a cached
read is told from a rebuilt one without timing anything.
"""
import dataclasses
import json

from prometheus_client.parser import text_string_to_metric_families

from llmgwctl.contracts import CatalogStatus, ControlStatus
from llmgwctl.observability.metrics import ControlMetrics
from llmgwctl.reconciler import Replica

from .test_reconciler import World, catalog, converge, model


def fleet(replicas=2):
    w = World(catalog(model("a", replicas=replicas)), settle=0)     # one node of 2 GPUs (World.report)
    converge(w)
    assert [r["state"] for r in w.rec.status()["replicas"]] == ["ready"] * replicas
    return w


def control(w) -> ControlStatus:
    cat = CatalogStatus(directory="catalogs", version=w.live.current.version, models=len(w.live.current),
                        swapped_at=None, swaps=0, rejections=0, directory_valid=True)
    return ControlStatus(catalog=cat, routers=0, fleet=w.rec.fleet_status(w.usage.snapshot))


def built(w) -> int:
    return w.rec._status_rows.built


def samples(metrics: ControlMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_the_json_body_is_the_same_document_as_to_dict():
    w = fleet()
    rid = sorted(w.rec.replicas)[0]
    w.usage.snapshot = {rid: (w.clock.now - 4.25, 2)}
    w.clock.now += 1
    state = control(w)
    assert json.loads(state.to_json()) == state.to_dict()
    (row,) = [r for r in state.to_dict()["replicas"] if r["id"] == rid]
    assert row["inflight"] == 2 and row["idle_seconds"] == 5.2


def test_repeated_reads_build_no_row_and_ages_still_move():
    w = fleet()
    first = w.rec.status()
    count = built(w)
    w.clock.now += 7.0          # time passes, nothing changes: no pass, no report
    again = w.rec.status()
    assert built(w) == count
    assert again["nodes"][0]["last_seen_seconds"] == first["nodes"][0]["last_seen_seconds"] + 7.0
    rid = sorted(w.rec.replicas)[0]
    w.usage.snapshot = {rid: (w.clock.now - 3.0, 1)}     # a request in flight: usage, not a record, moved
    (row,) = [r for r in w.rec.status(w.usage.snapshot)["replicas"] if r["id"] == rid]
    assert (row["inflight"], row["idle_seconds"]) == (1, 3.0)
    assert built(w) == count


def test_a_replica_that_changes_after_a_cached_read_shows_at_once_and_alone_is_rebuilt():
    w = fleet()
    metrics = ControlMetrics(lambda: control(w), process=False)
    before = samples(metrics)
    assert before[("llmgw_replicas", (("model", "a"), ("state", "ready")))] == 2
    assert {r["state"] for r in json.loads(control(w).to_json())["replicas"]} == {"ready"}   # cached now
    count = built(w)
    # Its engine crashes: the agent reports it failed, and the next pass takes that in.
    rid = sorted(w.rec.replicas)[1]
    w.running["n1"][rid]["state"] = "failed"
    w.running["n1"][rid]["reason"] = "exited with code 1"
    w.step()
    status = w.rec.status()
    (row,) = [r for r in status["replicas"] if r["id"] == rid]
    assert row["state"] == "failed" and row["reason"] == "exited with code 1"
    assert status["models"][0]["ready"] == 1
    assert json.loads(control(w).to_json())["replicas"] == status["replicas"]
    # That replica's row and its node's (the node's report said something new); not the other replica's.
    assert built(w) == count + 2
    after = samples(metrics)
    assert after[("llmgw_replicas", (("model", "a"), ("state", "ready")))] == 1
    assert after[("llmgw_replicas", (("model", "a"), ("state", "failed")))] == 1


def test_scrapes_without_a_change_build_no_row_and_report_fresh_ages():
    w = fleet()
    metrics = ControlMetrics(lambda: control(w), process=False)
    first = samples(metrics)
    count = built(w)
    w.clock.now += 5.0
    second = samples(metrics)
    assert built(w) == count
    age = ("llmgw_node_last_report_age_seconds", (("node", "n1"),))
    assert second[age] == first[age] + 5.0
    assert second[("llmgw_gpus", (("pool", "gpu"), ("state", "used")))] == 2


def test_a_node_that_reports_new_gpus_or_is_lost_gets_a_new_row():
    w = fleet(replicas=1)
    w.rec.status()
    count = built(w)
    w.report("n1", gpus=6)                  # a report that says something new
    assert w.rec.status()["nodes"][0]["gpus"] == 6
    assert built(w) == count + 1
    w.alive.discard("n1")
    for _ in range(4):
        w.quiet_pass(5.0)                   # no reports: past the node timeout
    (node,) = w.rec.status()["nodes"]
    assert node["state"] == "unreachable"
    assert {r["state"] for r in w.rec.status()["replicas"]} <= {"lost"}


def test_the_console_sees_news_in_a_state_change_not_in_ages():
    w = fleet()
    quiet = control(w).unaged()
    w.quiet_pass(1.0)                       # a pass that finds nothing: the pass count moves
    w.clock.now += 8.0
    w.report("n1")                          # the same report again: its age and report count move
    assert control(w).unaged() == quiet
    rid = sorted(w.rec.replicas)[0]
    w.running["n1"][rid]["state"] = "failed"
    w.step()
    assert control(w).unaged() != quiet


def test_a_record_replaced_under_the_same_id_shows_where_the_new_one_runs():
    # As when a replica given up with its lost node is adopted again: a new record, the same id.
    w = fleet(replicas=1)
    ((rid, rec),) = w.rec.replicas.items()
    (held,) = rec.spec.gpu_indices
    gpus = {g["index"]: g["used_by"] for g in w.rec.status()["nodes"][0]["gpu_list"]}
    assert gpus == {held: rid, 1 - held: None}
    spec = dataclasses.replace(rec.spec, gpu_indices=(1 - held,))
    w.rec.replicas[rid] = Replica(spec=spec, node=rec.node, created=rec.created, state=rec.state,
                                  reported=rec.reported)
    status = w.rec.status()
    assert {g["index"]: g["used_by"] for g in status["nodes"][0]["gpu_list"]} == {held: None, 1 - held: rid}
    assert status["replicas"][0]["gpus"] == [1 - held]


def test_the_status_table_of_a_big_fleet_counts_the_ready_and_lists_the_rest():
    from llmgwctl.cli.status import SUMMARY_ABOVE, render

    w = World(catalog(model("a", replicas=SUMMARY_ABOVE + 10)), settle=0)
    nodes = [f"n{i:03d}" for i in range(SUMMARY_ABOVE + 5)]       # 2 GPUs each: room to spare
    for node in nodes:
        w.report(node)
    converge(w, nodes=nodes)
    rid = sorted(w.rec.replicas)[3]
    node = w.rec.replicas[rid].node
    w.running[node][rid]["state"] = "failed"
    w.running[node][rid]["reason"] = "exited with code 1"
    w.step()
    status = control(w).to_dict()
    assert len(status["replicas"]) == SUMMARY_ABOVE + 10 and len(status["nodes"]) > SUMMARY_ABOVE
    text = render(status, now=w.clock.now)
    lines = text.splitlines()
    assert f"{SUMMARY_ABOVE + 10:,} replicas: {SUMMARY_ABOVE + 9:,} ready, 1 failed" in text
    assert f"{len(nodes):,} nodes: {len(nodes):,} ready" in text
    (row,) = [line for line in lines if line.startswith(rid)]      # its table row
    assert " failed " in row
    assert not [line for line in lines if line.startswith(("a-", "n0")) and " ready " in line]
    assert f"{rid} failed: exited with code 1" in text
    assert max(len(line) for line in lines) <= 100
    wide = render(status, now=w.clock.now, wide=True).splitlines()
    ids = {r["id"] for r in status["replicas"]}
    assert sum(line.split()[0] in ids for line in wide if line and not line.startswith(" ")) == SUMMARY_ABOVE + 10
    every = render(status, now=w.clock.now, every=True).splitlines()      # as `status --model` renders
    assert sum(line.split()[0] in ids for line in every if line and not line.startswith(" ")) == SUMMARY_ABOVE + 10
    # A ready replica the router holds out of routing is listed too, with the router's reason.
    held = next(r for r in status["replicas"] if r["state"] == "ready")
    held["router"] = "ejected by the router until it answers (at least 5 s): no answer to 3 health probes"
    lines = render(status, now=w.clock.now).splitlines()
    (row,) = [line for line in lines if line.startswith(held["id"])]
    assert " ready " in row
    assert f"{held['id']} ready: ejected by the router until it answers" in "\n".join(lines)


def test_what_the_router_holds_against_a_replica_is_in_its_row_and_in_the_table():
    from llmgwctl.cli.status import render

    w = fleet()
    rid = sorted(w.rec.replicas)[0]
    plain = control(w)
    assert [r["router"] for r in json.loads(plain.to_json())["replicas"]] == [None, None]
    held = dataclasses.replace(plain, fleet=dataclasses.replace(
        plain.fleet, router={rid: "ejected by the router for 30 s: answered 302, a redirect"}))
    doc = json.loads(held.to_json())
    assert doc == held.to_dict()
    assert {r["id"]: r["router"] for r in doc["replicas"]}[rid].endswith("answered 302, a redirect")
    assert held.unaged() != plain.unaged()          # the console's stream shows it at once
    assert f"{rid} ready: ejected by the router for 30 s: answered 302, a redirect" in render(doc)
