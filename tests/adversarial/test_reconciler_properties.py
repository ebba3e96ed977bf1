"""A catalog the rules accept can never make a reconcile pass raise (issue 13, item 3 and "loops").

At b616774 `weight: .nan` validated and then every reconcile pass raised: no
endpoint list was published for any model and requests for a new model hung
in the cold-start wait. The validator now refuses it; these tests hold the
reconciler's side. Catalogs are built through the catalog's own constructors
(so only valid ones exist) with values pushed to their bounds -- replicas up
to the maximum, weights and priorities at their ends, many profiles, zero- and
multi-GPU profiles, pools no node has -- and run against simulated agents
(reports through the real Inventory and the agent report contract) that
follow their desired lists, fail, vanish and come back, while a FakeClock
moves on. Every pass must complete and publish an endpoint list.
"""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgwctl.catalog import Catalog, CatalogError, Live
from llmgwctl.catalog.bounds import (
    MAX_GPUS,
    MAX_IDLE_TIMEOUT,
    MAX_REPLICAS,
    MAX_TOTAL_REPLICAS,
    MAX_WEIGHT,
    PRIORITY_RANGE,
)
from llmgwctl.catalog.model import EngineSpec, Model, Profile, Replicas
from llmgwctl.inventory import Inventory
from llmgwctl.reconciler import DesiredStore, Reconciler
from tests.reconciler.test_reconciler import Sink, Usage
from tests.support import FakeClock

BOUNDED = settings(max_examples=100, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
POOLS = ("a100", "h100", "cpu")
GHOST_POOL = "nobody-has-this"          # a pool no node carries: its profiles are never placeable
ENGINES = ("fake", "vllm", "llamacpp", "custom")
NODE_TIMEOUT, REPLACE_AFTER = 15.0, 60.0

weights = st.one_of(st.sampled_from([MAX_WEIGHT, 5e-324, 1e-300, 1.0]),
                    st.floats(min_value=0, max_value=MAX_WEIGHT, exclude_min=True, allow_nan=False))
priorities = st.one_of(st.sampled_from(PRIORITY_RANGE), st.integers(*PRIORITY_RANGE))
gpu_counts = st.one_of(st.sampled_from([0, 1, 2, 8, MAX_GPUS]), st.integers(0, MAX_GPUS))
replica_counts = st.one_of(st.sampled_from([0, 1, 2, MAX_REPLICAS]), st.integers(0, MAX_REPLICAS))
idle_timeouts = st.one_of(st.none(), st.sampled_from([0.0, 1.0, MAX_IDLE_TIMEOUT]),
                          st.floats(min_value=0, max_value=MAX_IDLE_TIMEOUT, allow_nan=False))


@st.composite
def profiles(draw, index: int) -> Profile:
    return Profile(
        name=f"p{index}", engine=draw(st.sampled_from(ENGINES)),
        pool=draw(st.sampled_from((None, GHOST_POOL) + POOLS)), gpus=draw(gpu_counts),
        priority=draw(priorities), weight=draw(weights),
        args=tuple(draw(st.lists(st.sampled_from(["--x", "1", "{port}"]), max_size=2))),
        env=draw(st.dictionaries(st.sampled_from(["A", "B"]), st.sampled_from(["1", ""]), max_size=2)),
    )


@st.composite
def catalogs(draw) -> Catalog:
    n = draw(st.integers(1, 12))
    models = []
    for i in range(n):
        low, high = sorted((draw(replica_counts), draw(replica_counts)))
        models.append(Model(
            name=f"m{i}", source=f"org/m{i}", aliases=(f"alias{i}",) if draw(st.booleans()) else (),
            replicas=Replicas(low, high), idle_timeout=draw(idle_timeouts),
            profiles=tuple(draw(profiles(j)) for j in range(draw(st.integers(1, 8)))),
        ))
    engines = {"custom": EngineSpec("custom", command=("serve", "{source}", "--port", "{port}"))}
    return Catalog(models, engines)


@st.composite
def nodes(draw) -> list[dict]:
    out = []
    for i in range(draw(st.integers(0, 4))):
        engines = {e: {"available": draw(st.booleans()), "reason": "not installed"} for e in ENGINES}
        out.append({"name": f"n{i}", "pools": draw(st.lists(st.sampled_from(POOLS), max_size=2, unique=True)),
                    "gpus": draw(st.sampled_from([0, 1, 2, 8, 16])), "engines": engines})
    return out


# What the simulated agents and the clock do between two passes.
steps = st.lists(st.fixed_dictionaries({
    "advance": st.sampled_from([0.0, 0.5, 1.0, 5.0, NODE_TIMEOUT + 1, REPLACE_AFTER + 1, MAX_IDLE_TIMEOUT]),
    "silent": st.sets(st.sampled_from([f"n{i}" for i in range(4)]), max_size=2),   # nodes that miss this report
    "outcome": st.sampled_from(["ready", "starting", "failed", "gone"]),           # what agents make of their lists
    "inflight": st.integers(0, 40),
    "wake": st.booleans(),
}), min_size=3, max_size=8)


def replica_report(spec, state: str, port: int) -> dict:
    return {"id": spec.id, "spec_hash": spec.spec_hash, "model": spec.model, "profile": spec.profile,
            "engine": spec.engine, "gpu_indices": list(spec.gpu_indices), "port": port, "pid": port,
            "state": state, "restarts": 0, "url": f"http://10.0.0.1:{port}", "spec": spec.to_dict(),
            "reason": "exit 1" if state == "failed" else ""}


def node_report(node: dict, replicas: list[dict]) -> dict:
    return {"node": node["name"], "boot_id": "boot-" + node["name"], "pools": node["pools"],
            "engines": node["engines"], "replicas": replicas,
            "gpus": [{"index": g, "uuid": f"{node['name']}-{g}", "name": "H100", "memory_mib": 81559}
                     for g in range(node["gpus"])]}


def run_fleet(first: Catalog, second: Catalog, fleet: list[dict], plan: list[dict], settle: float) -> None:
    clock = FakeClock()
    live = Live(first)
    inventory = Inventory(clock=clock, unreachable_after=NODE_TIMEOUT)
    desired = DesiredStore(first_version=1)
    sink, usage = Sink(), Usage()
    rec = Reconciler(live, inventory, desired, endpoints=sink, usage=usage, clock=clock, wall_clock=clock,
                     settle=settle, drain_grace=30, replace_after=REPLACE_AFTER)
    running: dict[str, list[dict]] = {n["name"]: [] for n in fleet}
    for node in fleet:
        inventory.report(node["name"], node_report(node, []))
    for i, step in enumerate(plan):
        if i == len(plan) // 2:
            live.swap(second)            # a catalog swap midway: orphans, new models, changed profiles
        clock.advance(step["advance"])
        for node in fleet:
            name = node["name"]
            entry = desired.get(name)
            specs = entry[1] if entry else ()
            state = step["outcome"]
            # The agent runs its list (or lost its engines: "gone"), numbered ports on its host.
            running[name] = [] if state == "gone" else [replica_report(s, state, 20000 + j) for j, s in enumerate(specs)]
            if name not in step["silent"]:
                inventory.report(name, node_report(node, running[name]))
        usage.snapshot = {r["id"]: (clock.now - 1, step["inflight"]) for reps in running.values() for r in reps}
        if step["wake"]:
            for model in live.current.models[:3]:
                rec.wake(model.name)
        rec.reconcile_once()              # must not raise, whatever the catalog and the fleet
        assert sink.pushes, "the first pass publishes an endpoint list"
        ready = {r.spec.id for r in rec.replicas.values() if r.state.value == "ready"}
        for endpoint in rec.endpoints:
            assert endpoint.replica_id in ready and live.current.resolve(endpoint.model) is not None
            assert math.isfinite(endpoint.weight) and endpoint.weight > 0
        json.dumps(rec.status(usage.snapshot))   # what status serves must serialise
        rec.preview(second)                      # what `catalog apply` runs, on the loop, must not raise either


@BOUNDED
@given(catalogs(), catalogs(), nodes(), steps, st.sampled_from([0.0, 5.0]))
def test_no_valid_catalog_and_fleet_makes_a_pass_raise(first, second, fleet, plan, settle):
    run_fleet(first, second, fleet, plan, settle)


def test_a_catalog_at_every_bound_reconciles():
    # The extremes at once, which random draws seldom combine: the catalog's
    # whole replica budget, GPU-less profiles (which fit any node), weights and
    # priorities at both ends, and one profile per pool no node has.
    per_model = MAX_TOTAL_REPLICAS // MAX_REPLICAS
    models = [Model(name=f"m{i}", source="s", replicas=Replicas(MAX_REPLICAS, MAX_REPLICAS), profiles=(
        Profile(name="gpu", engine="fake", pool="h100", gpus=MAX_GPUS, priority=PRIORITY_RANGE[1], weight=MAX_WEIGHT),
        Profile(name="ghost", engine="fake", pool=GHOST_POOL, gpus=1, priority=0, weight=5e-324),
        Profile(name="cpu", engine="fake", gpus=0, priority=PRIORITY_RANGE[0], weight=1e-300),
    )) for i in range(per_model)]
    catalog = Catalog(models)
    fleet = [{"name": f"n{i}", "pools": ["h100"], "gpus": 8,
              "engines": {"fake": {"available": True, "reason": ""}}} for i in range(3)]
    plan = [{"advance": 1.0, "silent": set(), "outcome": o, "inflight": 0, "wake": False}
            for o in ("starting", "ready", "ready")]
    run_fleet(catalog, catalog, fleet, plan, settle=0.0)


@pytest.mark.parametrize("field, value", [
    ("weight", float("nan")), ("weight", float("inf")), ("weight", 0.0), ("weight", -1.0),
    ("weight", MAX_WEIGHT * 2), ("priority", PRIORITY_RANGE[1] + 1), ("gpus", MAX_GPUS + 1), ("gpus", -1),
])
def test_a_catalog_built_in_code_refuses_what_would_break_a_pass(field, value):
    # The constructor is the one gate: a Catalog holding a NaN weight cannot
    # exist, however it was built (not only through the loader's schema).
    profile = Profile(name="p", engine="fake", **{field: value})
    with pytest.raises(CatalogError, match=field):
        Catalog([Model(name="m", profiles=(profile,))])


@pytest.mark.parametrize("replicas", [Replicas(0, MAX_REPLICAS + 1), Replicas(-1, 1)])
def test_a_catalog_built_in_code_refuses_unbounded_replicas(replicas):
    with pytest.raises(CatalogError, match="replicas"):
        Catalog([Model(name="m", replicas=replicas, profiles=(Profile(name="p", engine="fake"),))])


def test_the_whole_catalog_replica_budget_holds_across_models():
    models = [Model(name=f"m{i}", replicas=Replicas(0, MAX_REPLICAS), profiles=(Profile(name="p", engine="fake"),))
              for i in range(MAX_TOTAL_REPLICAS // MAX_REPLICAS + 1)]
    with pytest.raises(CatalogError, match="more than 100000 replicas"):
        Catalog(models)
