"""An adapter's spread following its own load: more holders past the target, fewer after a calm window.

The placer is driven with a fake clock and made-up counters (an AdapterLoadSource
that a test advances as if `inflight` requests had been in flight since the last
pass), so the autoscaler's rules show per adapter without any router.
"""
from llmgwctl.catalog import load_text
from llmgwctl.contracts import ReplicaState
from llmgwctl.reconciler.adapters import AdapterPlacer
from tests.reconciler.test_adapters import HEADER, placed, records

GROWING = ("      - name: hot\n        source: /hot\n        replicas: {min: 1, max: 3}\n"
           "        autoscale: {target: 4, scale_down_window: 30s}\n"
           "      - {name: cold, source: /cold, replicas: 1}\n")


def catalog(adapters: str = GROWING):
    return load_text(HEADER + "    adapters:\n" + adapters)


class Load:
    """Per adapter, request-seconds counters that `run` grows as if `inflight` were in flight for `seconds`."""

    def __init__(self):
        self.counters: dict[str, float] = {}
        self.reads = 0

    def adapter_inflight_seconds(self):
        self.reads += 1
        return dict(self.counters)

    def run(self, name: str, inflight: float, seconds: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + inflight * seconds


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def holders(recs, name: str) -> list[str]:
    return sorted(rid for rid, v in placed(recs).items() if name in v)


def setup(n: int = 4, cat=None):
    cat = cat or catalog()
    recs = records(cat, n)
    load, clock, events = Load(), Clock(), []
    placer = AdapterPlacer(recs, load=load, clock=clock, event=lambda kind, msg: events.append((kind, msg)))
    return cat, recs, load, clock, placer, events


def passes(placer, cat, load, clock, inflight: float, n: int, name: str = "hot") -> None:
    """`n` passes a second apart with `inflight` requests of `name` in flight throughout."""
    for _ in range(n):
        clock.now += 1.0
        load.run(name, inflight)
        placer.place(cat)


def spread_to_three():
    """`setup()`'s placer after three passes at 9.5 in flight on hot: spread to its max of 3."""
    cat, recs, load, clock, placer, events = setup()
    placer.place(cat)
    passes(placer, cat, load, clock, inflight=9.5, n=3)
    assert len(holders(recs, "hot")) == 3
    return cat, recs, load, clock, placer, events


def test_a_quiet_adapter_keeps_its_floor_and_a_busy_one_spreads_to_what_its_load_needs():
    cat, recs, load, clock, placer, events = setup()
    placer.place(cat)
    passes(placer, cat, load, clock, inflight=2.0, n=5)
    assert len(holders(recs, "hot")) == 1
    # 9.5 in flight against 4 per holder: ceil(9.5 / 4) = 3 (the first pass's 2 s mean still has
    # the 2 of before in it: a step to 2, then 3).
    passes(placer, cat, load, clock, inflight=9.5, n=3)
    assert len(holders(recs, "hot")) == 3
    assert len(holders(recs, "cold")) == 1          # a fixed adapter does not move with its neighbour's load
    msg = [m for kind, m in events if kind == "adapter-spread"][-1]
    assert "adapter hot of base: spread to 3 replicas" in msg and "inflight 9.5" in msg
    (spread,) = [s for s in placer.spreads(cat.models[0]) if s.name == "hot"]
    assert (spread.holders, spread.of, spread.floor, spread.ceiling, spread.target) == (3, 4, 1, 3, 4.0)
    assert spread.why().startswith("spread to 3 of 4 replicas: 9.5 in flight against a target of 4")


def test_never_past_its_max_nor_past_the_replicas_the_base_runs():
    cat = catalog("      - name: hot\n        source: /hot\n        replicas: {min: 1, max: 8}\n"
                  "        autoscale: {target: 1}\n")
    cat_, recs, load, clock, placer, _ = setup(3, cat)
    placer.place(cat)
    passes(placer, cat, load, clock, inflight=50.0, n=4)
    assert len(holders(recs, "hot")) == 3
    (spread,) = placer.spreads(cat.models[0])
    assert spread.holders == 3 and spread.of == 3


def test_within_the_tolerance_band_nothing_moves():
    cat, recs, load, clock, placer, _ = setup()
    placer.place(cat)
    passes(placer, cat, load, clock, inflight=8.0, n=3)
    assert len(holders(recs, "hot")) == 2
    # 8.6 on 2 holders is 4.3 each: ceil(8.6 / 4) = 3, but within 10 % of the target, so no third.
    passes(placer, cat, load, clock, inflight=8.6, n=5)
    assert len(holders(recs, "hot")) == 2
    # 9.5 is 4.75 each: past the band.
    passes(placer, cat, load, clock, inflight=9.5, n=3)
    assert len(holders(recs, "hot")) == 3


def test_it_shrinks_back_only_after_a_calm_window_and_the_holders_left_keep_it():
    cat, recs, load, clock, placer, events = spread_to_three()
    before = holders(recs, "hot")
    assert len(before) == 3
    # The load stops: for most of the 30 s window the three stay.
    passes(placer, cat, load, clock, inflight=0.0, n=25)
    assert holders(recs, "hot") == before
    passes(placer, cat, load, clock, inflight=0.0, n=10)
    after = holders(recs, "hot")
    # Down by at most max_step (2) a step: back to its floor of 1, one of the holders it had.
    assert len(after) == 1 and set(after) <= set(before)
    assert any("back to 1 replica" in msg for _, msg in events)


def test_a_pass_with_nothing_new_writes_nothing_and_no_growing_adapter_reads_no_counter():
    cat, recs, load, clock, placer, _ = setup()
    placer.place(cat)
    passes(placer, cat, load, clock, inflight=1.0, n=3)
    specs = [r.spec for r in recs.values()]
    recs.changed_ids.clear()
    passes(placer, cat, load, clock, inflight=1.0, n=3)
    assert all(a is b.spec for a, b in zip(specs, recs.values())) and not recs.changed_ids
    fixed = load_text(HEADER + "    adapters:\n      - {name: cold, source: /cold, replicas: 1}\n")
    _, recs2, load2, clock2, placer2, _ = setup(3, fixed)
    for _ in range(3):
        clock2.now += 1
        placer2.place(fixed)
    assert load2.reads == 0


def test_no_counters_no_spread_change():
    # A router from before the per-adapter counters (or no router at all) sends none: the floor holds.
    cat, recs, load, clock, placer, _ = setup()
    for _ in range(10):
        clock.now += 1
        placer.place(cat)
    assert len(holders(recs, "hot")) == 1


def test_a_counter_reset_is_no_reading_not_negative_load():
    cat, recs, load, clock, placer, _ = spread_to_three()
    load.counters["hot"] = 0.0      # the router restarted
    clock.now += 1
    placer.place(cat)
    assert len(holders(recs, "hot")) == 3


def test_a_replica_leaving_gives_its_share_to_another_and_the_spread_recounts():
    cat, recs, load, clock, placer, _ = spread_to_three()
    gone = holders(recs, "hot")[0]
    recs[gone].state = ReplicaState.DRAINING
    passes(placer, cat, load, clock, inflight=9.5, n=1)
    serving = [rid for rid in holders(recs, "hot") if recs[rid].state is ReplicaState.READY]
    assert len(serving) == 3


def test_a_policy_edit_keeps_the_holders_and_waits_a_new_window_to_shrink():
    cat, recs, load, clock, placer, _ = spread_to_three()
    passes(placer, cat, load, clock, inflight=0.0, n=25)      # most of the old 30 s window calm
    edited = catalog(GROWING.replace("target: 4, scale_down_window: 30s", "target: 5, scale_down_window: 20s"))
    passes(placer, edited, load, clock, inflight=0.0, n=15)
    assert len(holders(recs, "hot")) == 3
    passes(placer, edited, load, clock, inflight=0.0, n=10)
    assert len(holders(recs, "hot")) == 1


def test_a_lower_max_takes_holders_at_once_and_a_fixed_count_too():
    cat, recs, load, clock, placer, _ = spread_to_three()
    lower = catalog(GROWING.replace("max: 3", "max: 2"))
    clock.now += 1
    load.run("hot", 9.5)
    placer.place(lower)
    assert len(holders(recs, "hot")) == 2
    fixed = catalog(GROWING.replace("replicas: {min: 1, max: 3}", "replicas: 1")
                    .replace("        autoscale: {target: 4, scale_down_window: 30s}\n", ""))
    clock.now += 1
    placer.place(fixed)
    assert len(holders(recs, "hot")) == 1


def test_through_the_reconciler_status_metrics_and_events_say_how_far_and_why():
    from prometheus_client.parser import text_string_to_metric_families

    from llmgwctl.cli.status import render
    from llmgwctl.observability.metrics import ControlMetrics

    from .test_reconciler import World, converge
    from .test_status_rows import control

    cat = load_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: base\n    replicas: 4\n"
                    "    profiles: [{name: p, engine: fake, pool: gpu, gpus: 0}]\n"
                    "    adapters:\n" + GROWING)
    w = World(cat, settle=0)
    load = Load()
    w.rec.adapters.load = load
    converge(w)
    assert sum("hot" in [a.name for a in s.adapters] for s in w.desired.get("n1")[1]) == 1
    for _ in range(4):
        load.run("hot", 9.5)
        w.step()
    assert sum("hot" in [a.name for a in s.adapters] for s in w.desired.get("n1")[1]) == 3
    status = w.rec.status()
    (base,) = status["models"]
    hot, cold = base["adapters"]
    assert (hot["name"], hot["holders"], hot["of"], hot["min"], hot["max"]) == ("hot", 3, 4, 1, 3)
    assert hot["reason"].startswith("spread to 3 of 4 replicas: 9.5 in flight against a target of 4")
    assert (cold["holders"], cold["load"]) == (1, None)
    text = render(status | {"catalog": {"version": "v", "models": 1, "directory": "catalogs"}}, now=w.clock.now)
    assert "adapter hot of base spread to 3 of 4 replicas: 9.5 in flight against a target of 4" in text
    assert "adapter cold" not in text       # a fixed adapter's holders are on the replica lines
    assert any(e["kind"] == "adapter-spread" for e in status["events"])
    metrics = ControlMetrics(lambda: control(w), process=False)
    found = {(s.name, s.labels.get("adapter")): s.value
             for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples
             if s.name.startswith("llmgw_adapter_")}
    assert found[("llmgw_adapter_spread", "hot")] == 3 and found[("llmgw_adapter_inflight", "hot")] == 9.5
    assert ("llmgw_adapter_spread", "cold") not in found
