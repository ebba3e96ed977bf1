"""The console's live updates stay small at fleet size: 5,000 simulated nodes, 20,000 replicas (issue 31).

The fleet is tests/fleetsim.py's: its `SimAgent`s build their reports from the
contract types and run what they are told, here handed to a real `Controller`
in process (reports taken as the agent service takes them, desired lists read
from the store the long-poll answers from) instead of over HTTP, so the test
needs one core for a few seconds, not a fleet's worth of sockets. What the
console's stream sends is then measured as the stream builds it: the summary
(`control.summary`) and the history's new point (`control.history`), each
under 100 KB, where the whole status is megabytes. The time each takes is
printed, not judged (no timed assertion): bench/README.md keeps the figures.
"""
from __future__ import annotations

import asyncio
import json
import time

from llmgwctl.contracts import RequestRecord
from llmgwctl.control.controller import Controller
from llmgwctl.control.summary import NODE_ROWS, REPLICA_ROWS, Summaries

from ..fleetsim import ENGINE_YAML, SimFleet

NODES, GPUS, MODELS = 5000, 4, 20
REPLICAS = NODES * GPUS // MODELS       # 1,000 a model: the catalog's bound
LIMIT = 100_000
CATALOG = ("apiVersion: llmgw/v1\nkind: Catalog\n" + ENGINE_YAML + "models:\n" + "".join(
    f"  - name: m{i:02d}\n    source: sim/m{i}\n    replicas: {REPLICAS}\n"
    f"    profiles: [{{name: p, engine: sim, gpus: 1}}]\n" for i in range(MODELS)))


def test_the_console_stream_sends_under_100_kb_an_update_at_5000_nodes(tmp_path):
    (tmp_path / "fleet.yaml").write_text(CATALOG)

    async def main():
        c = Controller(str(tmp_path), settle=0)
        c.load()
        sim = SimFleet("http://sim.invalid", NODES, gpus=GPUS, ready_after=(0.0, 0.0))
        for a in sim.agents:
            c.agent_reported(a.name, a.report())
        # Place, start, report ready: a few rounds of what agents and the reconciler do over HTTP.
        for _ in range(4):
            c.reconciler.reconcile_once()
            for a in sim.agents:
                got = c.desired.get(a.name)
                if got is not None:
                    a.apply(got[1])
            await asyncio.sleep(0.01)       # the agents' replicas turn ready (call_later(0))
            for a in sim.agents:
                c.agent_reported(a.name, a.report())
        c.reconciler.reconcile_once()
        status = c.state()
        ready = sum(1 for r in status.fleet.replicas if r.state.value == "ready")
        assert len(status.fleet.replicas) == NODES * GPUS and ready == NODES * GPUS, (len(status.fleet.replicas), ready)

        # Traffic on every model, so the history's point and the summary's in-flight counts are not empty.
        for i in range(MODELS * 50):
            c.requests.record(RequestRecord(at=time.time(), id=f"r{i}", key="k", asked=f"m{i % MODELS:02d}",
                                            model=f"m{i % MODELS:02d}", status=200, ttft=0.05 + i / 1e4,
                                            duration=0.5, tokens_in=10, tokens_out=100, replica="x"))
        c.sample_history()
        c.sample_history()

        summaries = Summaries()
        t0 = time.perf_counter()
        summary = summaries(c.state())
        body = summary.to_json()
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = summaries(c.state())
        keyed = time.perf_counter() - t0
        point = json.dumps(c.history.to_dict(since=c.history.to_dict()["t"][-2]), separators=(",", ":")).encode()
        whole = c.status_json()
        print(f"\nat {NODES} nodes, {NODES * GPUS} replicas: summary {len(body):,} B in {built * 1e3:.1f} ms "
              f"(the next, rows unchanged, in {keyed * 1e3:.1f} ms, the status read included), history point {len(point):,} B, "
              f"the whole status {len(whole):,} B")
        assert len(body) < LIMIT, len(body)
        assert len(point) < LIMIT, len(point)
        assert len(whole) > 20 * len(body), "the summary is no smaller than the status"
        doc = json.loads(body)
        assert doc["replicas_total"] == NODES * GPUS and len(doc["replicas"]) == REPLICA_ROWS
        assert doc["nodes_total"] == NODES and len(doc["nodes"]) == NODE_ROWS
        assert doc["counts"]["replicas"] == {"ready": NODES * GPUS} and doc["counts"]["gpus_used"] == NODES * GPUS
        assert len(doc["models"]) == MODELS
        # Nothing changed but ages: the stream would send nothing.
        assert again.key == summary.key
        # A replica failing is news, and it comes first among the rows shown.
        a = sim.agents[17]
        victim = next(iter(a.replicas.values()))
        victim.state = victim.state.__class__("failed")
        c.agent_reported(a.name, a.report())
        c.reconciler.reconcile_once()
        after = summaries(c.state())
        assert after.key != summary.key
        shown = json.loads(after.to_json())["replicas"]
        assert shown[0]["id"] == victim.spec.id and len(after.to_json()) < LIMIT

    asyncio.run(main())


def test_a_catalog_of_a_thousand_models_keeps_the_summary_small(tmp_path):
    from llmgwctl.control.summary import MODEL_ROWS

    (tmp_path / "many.yaml").write_text("apiVersion: llmgw/v1\nkind: Catalog\n" + ENGINE_YAML + "models:\n" + "".join(
        f"  - name: model-{i:04d}\n    aliases: [alias-{i:04d}]\n    source: sim/m{i}\n    replicas: 1\n"
        f"    profiles: [{{name: p, engine: sim, gpus: 1}}]\n" for i in range(1000)))
    c = Controller(str(tmp_path), settle=0)
    c.load()
    # Nodes of 8 GPUs, each row listing them, and replicas placed but not started: the summary's
    # largest rows, and every one of them shown.
    sim = SimFleet("http://sim.invalid", 40, gpus=8)
    for a in sim.agents:
        c.agent_reported(a.name, a.report())
    c.reconciler.reconcile_once()
    c.sample_history()
    body = Summaries()(c.state()).to_json()
    doc = json.loads(body)
    assert doc["models_total"] == 1000 and len(doc["models"]) == MODEL_ROWS
    assert len(doc["replicas"]) == REPLICA_ROWS and len(doc["nodes"]) == NODE_ROWS
    print(f"\n1,000 models, {REPLICA_ROWS} replicas and {NODE_ROWS} nodes of 8 GPUs shown: summary {len(body):,} B")
    assert len(body) < LIMIT
    # What the stream sends of the history: as many models as the page charts.
    from llmgwctl.control.webui import CHART_MODELS
    assert len(c.history.to_dict(first=CHART_MODELS)["models"]) == CHART_MODELS


def test_open_pages_share_one_summary_built_and_encoded_once_per_change(tmp_path):
    # N consoles must cost one summary, not N: at 20,000 replicas one is tens of milliseconds to build.
    from llmgwctl.control.webui import Console

    (tmp_path / "fleet.yaml").write_text(CATALOG)
    c = Controller(str(tmp_path), settle=0)
    c.load()
    summaries, built = Summaries(), []

    def summary():
        built.append(1)
        return summaries(c.state())
    console = Console(c.state, c.status_changed, summary=summary, history=c.history)
    pages = [console.shared_summary(100.0) for _ in range(5)]
    assert len(built) == 1 and all(p is pages[0] for p in pages)
    # Each page sends the same bytes: one encoding, not one a page.
    assert pages[0].to_json() is pages[0].to_json()
    assert json.loads(pages[0].to_json())["models_total"] == MODELS
    c.status_changed.bump()
    assert console.shared_summary(100.0) is not pages[0] and len(built) == 2


def test_an_hour_of_history_reaches_a_new_page_in_parts_under_100_kb():
    # The first event, the last hour of the models the page charts, is ~1 MB whole.
    from llmgwctl.control.history import POINTS, History, ModelSample
    from llmgwctl.control.webui import CHART_MODELS, history_events

    h = History()
    names = [f"m{i:04d}" for i in range(100)]
    t0 = time.time() - POINTS * h.interval
    for k in range(POINTS):
        for j in range(2 * CHART_MODELS):
            h.observe(RequestRecord(at=0, id="x", key=None, asked=names[j], model=names[j], status=200,
                                    ttft=0.01 * (1 + j % 7), duration=1, tokens_in=30, tokens_out=200, replica="r"))
        h.sample(t0 + k * h.interval, (ModelSample(n, k % 4, 19, 18, 1.5 + k % 3 / 7, 2.0) for n in names))
    doc = h.to_dict(first=CHART_MODELS)
    whole = len(json.dumps(doc, separators=(",", ":")))
    events = history_events(doc)
    sizes = [len(data) for _, data in events]
    print(f"\nan hour of {CHART_MODELS} models: {whole:,} B whole, {len(events)} events of at most {max(sizes):,} B")
    assert whole > LIMIT and max(sizes) < LIMIT
    head, *parts = events
    assert head[0] == b"history" and all(kind == b"history-part" for kind, _ in parts)
    first = json.loads(head[1])
    assert first["t"] == doc["t"] and first["fleet"] == doc["fleet"] and first["models"] == {}
    merged = {}
    for _, data in parts:
        part = json.loads(data)
        assert part["t"] == doc["t"]
        merged.update(part["models"])
    assert merged == doc["models"]
    # A new point alone is one event, as ever.
    assert [k for k, _ in history_events(h.to_dict(since=doc["t"][-2], first=CHART_MODELS))] == [b"history"]
