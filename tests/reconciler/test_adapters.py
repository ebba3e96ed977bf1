"""Adapter placement on a base's replicas: every one, or N spread, holders kept, leaving replicas skipped."""
from llmgwctl.catalog import load_text
from llmgwctl.contracts import ReplicaSpec, ReplicaState
from llmgwctl.reconciler.adapters import AdapterPlacer
from llmgwctl.reconciler.records import Records, Replica

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: base\n    profiles: [{engine: fake, gpus: 0}]\n"


def catalog(adapters: str):
    return load_text(HEADER + ("    adapters:\n" + adapters if adapters else "    lora: {max_loras: 2}\n"))


def records(catalog, n: int, state=ReplicaState.READY) -> Records:
    recs = Records()
    model = catalog.models[0]
    for i in range(n):
        spec = ReplicaSpec.for_profile(f"r{i}", model, model.profiles[0], catalog.engines["fake"])
        recs[spec.id] = Replica(spec=spec, node="n", created=0.0, state=state)
    return recs


def placed(recs: Records) -> dict[str, list[str]]:
    return {rid: [a.name for a in rec.spec.adapters] for rid, rec in recs.items()}


def test_all_goes_everywhere_and_a_number_is_spread_over_the_least_loaded():
    cat = catalog("      - {name: a, source: /a}\n      - {name: b, source: /b, replicas: 2}\n"
                  "      - {name: c, source: /c, replicas: 1}\n      - {name: d, source: /d, replicas: 1}\n")
    recs = records(cat, 3)
    AdapterPlacer(recs).place(cat)
    assert sorted(len(v) for v in placed(recs).values()) == [2, 2, 3]
    counts = {name: sum(name in v for v in placed(recs).values()) for name in "abcd"}
    assert counts == {"a": 3, "b": 2, "c": 1, "d": 1}


def test_the_hash_is_kept_and_the_record_marked_changed():
    cat = catalog("      - {name: a, source: /a}\n")
    recs = records(cat, 1)
    before = recs["r0"].spec.spec_hash
    recs.changed_ids.clear()
    AdapterPlacer(recs).place(cat)
    assert recs["r0"].spec.spec_hash == before and [a.source for a in recs["r0"].spec.adapters] == ["/a"]
    assert "r0" in recs.changed_ids and "n" in recs.changed_nodes


def test_holders_keep_an_adapter_and_a_leaving_replica_passes_it_on():
    cat = catalog("      - {name: a, source: /a, replicas: 1}\n")
    recs = records(cat, 3)
    placer = AdapterPlacer(recs)
    placer.place(cat)
    (holder,) = [rid for rid, v in placed(recs).items() if v]
    # A new replica (fewer adapters) does not take it from its holder.
    model = cat.models[0]
    spec = ReplicaSpec.for_profile("r9", model, model.profiles[0], cat.engines["fake"])
    recs["r9"] = Replica(spec=spec, node="n", created=0.0)
    placer.place(cat)
    assert [rid for rid, v in placed(recs).items() if v] == [holder]
    # The holder drains: another replica gets it; the draining one keeps what it had until it is gone.
    recs[holder].state = ReplicaState.DRAINING
    placer.place(cat)
    now = sorted(rid for rid, v in placed(recs).items() if v)
    assert len(now) == 2 and holder in now


def test_removing_adapters_empties_the_specs_and_nothing_changes_without_news():
    cat = catalog("      - {name: a, source: /a}\n")
    recs = records(cat, 2)
    placer = AdapterPlacer(recs)
    placer.place(cat)
    specs = [rec.spec for rec in recs.values()]
    recs.changed_ids.clear()
    placer.place(cat)
    assert [rec.spec for rec in recs.values()] == specs and all(a is b for a, b in zip(specs, [r.spec for r in recs.values()]))
    without = catalog("")
    placer.place(without)
    assert placed(recs) == {"r0": [], "r1": []}


def test_through_the_reconciler_an_adapter_is_served_where_placed_and_reported_loaded():
    from prometheus_client.parser import text_string_to_metric_families

    from llmgwctl.observability.metrics import ControlMetrics

    from .test_reconciler import World, converge
    from .test_status_rows import control

    cat = load_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: base\n    replicas: 2\n"
                    "    profiles: [{name: p, engine: fake, pool: gpu, gpus: 1}]\n"
                    "    adapters: [{name: sql, source: /srv/sql, replicas: 1}]\n")
    w = World(cat, settle=0)
    converge(w)
    # The desired list places sql on one replica; nothing routes it until its agent says it is loaded.
    (entry,) = [w.desired.get("n1")]
    holder = next(s.id for s in entry[1] if [a.name for a in s.adapters] == ["sql"])
    assert sum(bool(s.adapters) for s in entry[1]) == 1
    assert all(not ep.adapters for ep in w.sink.pushes[-1])
    w.running["n1"][holder]["adapters"] = [{"name": "sql", "state": "loaded"}]
    w.step()
    (ep,) = [ep for ep in w.sink.pushes[-1] if ep.adapters]
    assert ep.replica_id == holder and ep.adapters == frozenset({"sql"})
    rows = {r["id"]: r["adapters"] for r in w.rec.status()["replicas"]}
    assert rows[holder] == [{"name": "sql", "state": "loaded"}]
    metrics = ControlMetrics(lambda: control(w), process=False)
    found = {(s.labels["adapter"], s.labels["state"]): s.value
             for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples
             if s.name == "llmgw_adapter_replicas"}
    assert found[("sql", "loaded")] == 1 and found[("sql", "failed")] == 0
    # Removed from the catalog: out of the endpoint at once, though the agent still reports it loaded.
    w.live.swap(load_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: base\n    replicas: 2\n"
                          "    lora: {max_loras: 4, max_rank: 16}\n"
                          "    profiles: [{name: p, engine: fake, pool: gpu, gpus: 1}]\n"))
    w.step()
    assert all(not ep.adapters for ep in w.sink.pushes[-1])
    assert all(not s.adapters for s in w.desired.get("n1")[1])
    rows = {r["id"]: r["adapters"] for r in w.rec.status()["replicas"]}
    assert rows[holder] == [{"name": "sql", "state": "loaded"}]     # reported, no longer placed: leaving


def test_a_llamacpp_base_launches_with_every_adapter_and_an_adapter_edit_replaces_it_saying_why():
    from llmgwctl.catalog.modelrules import LAUNCH_LORA_REASON

    from .test_reconciler import World, converge

    def llama(adapters: str):
        return load_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: base\n    replicas: 1\n"
                         "    profiles: [{name: p, engine: llamacpp, pool: gpu, gpus: 1}]\n"
                         f"    adapters: [{adapters}]\n")

    two = llama("{name: a, source: /a.gguf}, {name: b, source: /b.gguf}")
    w = World(two, settle=0)
    w.engines = ("fake", "llamacpp")
    converge(w)
    (spec,) = w.desired.get("n1")[1]
    assert [a.name for a in spec.adapters] == ["a", "b"]
    # Routed once its agent read the engine's numbers, which the endpoint carries.
    assert all(not ep.adapters for ep in w.sink.pushes[-1])
    w.running["n1"][spec.id]["adapters"] = [{"name": "a", "state": "loaded", "engine_id": 0},
                                            {"name": "b", "state": "loaded", "engine_id": 1}]
    w.step()
    (ep,) = w.sink.pushes[-1]
    assert ep.adapters == frozenset({"a", "b"}) and dict(ep.adapter_ids) == {"a": 0, "b": 1}
    # An adapter added: `catalog apply` would replace the replica, and says why.
    three = llama("{name: a, source: /a.gguf}, {name: c, source: /c.gguf}, {name: b, source: /b.gguf}")
    (replace,) = w.rec.preview(three)["replace"]
    assert (replace["id"], replace["why"]) == (spec.id, LAUNCH_LORA_REASON)
    w.live.swap(three)
    w.step()
    # The running replica keeps the adapters it was launched with (the placer does not write them) and
    # serves on while its replacement starts with all three; status says why c is not on it.
    assert w.rec.replicas[spec.id].spec.adapters == spec.adapters
    row = next(r for r in w.rec.status()["replicas"] if r["id"] == spec.id)
    assert {"name": "c", "state": "loading", "reason": LAUNCH_LORA_REASON} in row["adapters"]
    (new,) = [s for s in w.desired.get("n1")[1] if s.id != spec.id]
    assert [a.name for a in new.adapters] == ["a", "c", "b"] and new.spec_hash != spec.spec_hash
    assert [ep.replica_id for ep in w.sink.pushes[-1]] == [spec.id]
    # Ready: the old one leaves, surge done.
    for _ in range(40):
        w.step()
        w.agent_follows("n1")
        if [s.id for s in w.desired.get("n1")[1]] == [new.id]:
            break
    assert [s.id for s in w.desired.get("n1")[1]] == [new.id]
