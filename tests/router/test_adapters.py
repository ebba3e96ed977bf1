"""Requests for LoRA adapters: only to the replicas that hold them, renamed to the adapter, 503 while none does."""
from __future__ import annotations

import dataclasses

import requests

from llmgwctl.catalog import Adapter, Model, Profile
from llmgwctl.contracts import Endpoint
from llmgwctl.router.balancer import Balancer

from .harness import catalog, make_router

BASE = Model(name="base", source="org/base", profiles=(Profile(name="default", engine="fake", gpus=0),),
             adapters=(Adapter("sql", "/srv/sql", aliases=("sql-lora",)), Adapter("chat", "/srv/chat")))


def ask(url: str, model: str, content: str = "hi") -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=30,
                         json={"model": model, "messages": [{"role": "user", "content": content}]})


def load(engine, name: str) -> None:
    assert requests.post(engine.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"hub/{name}"},
                         timeout=10).ok


def test_the_balancer_picks_an_adapter_only_among_its_holders_and_follows_changes():
    b = Balancer()
    e1 = Endpoint("r1", "base", "p", "fake", "http://127.0.0.1:1", adapters=frozenset({"sql"}))
    e2 = Endpoint("r2", "base", "p", "fake", "http://127.0.0.1:2")
    gained = b.set_endpoints([e1, e2])
    assert gained == {"base", "sql"}
    assert {b.pick("sql").replica_id for _ in range(50)} == {"r1"}
    assert {b.pick("base").replica_id for _ in range(50)} == {"r1", "r2"}
    # Loaded on r2 too: the same state object (its counts stand), now picked for sql as well.
    before = b.state_of("r2")
    before.inflight = 3
    assert b.set_endpoints([e1, dataclasses.replace(e2, adapters=frozenset({"sql"}))]) == {"sql"}
    assert b.state_of("r2") is before and before.inflight == 3
    assert b.ready_count("sql") == 2
    # Unloaded from both: no pick for sql, the base unchanged.
    b.set_endpoints([dataclasses.replace(e1, adapters=frozenset()), e2])
    assert b.pick("sql") is None and b.ready_count("base") == 2


def test_adapter_requests_go_to_holders_as_the_adapter_and_503_while_none_holds_one(engines, routers):
    one, two = engines("base", "r1", "--max-loras", "2"), engines("base", "r2", "--max-loras", "2")
    load(one, "sql")
    rt = routers(make_router(catalog(BASE)))
    rt.set_endpoints([dataclasses.replace(one.endpoint(), adapters=frozenset({"sql"})), two.endpoint()])
    answers = [ask(rt.url, "sql-lora", f"q{i}") for i in range(20)]
    assert all(a.status_code == 200 for a in answers), answers[0].text
    assert {a.headers["x-llmgw-replica"] for a in answers} == {"r1"}
    # The engine is asked for the adapter by its own name; the client hears back the alias it asked for.
    assert {a.json()["model"] for a in answers} == {"sql-lora"}
    assert len({ask(rt.url, "base", f"q{i}").headers["x-llmgw-replica"] for i in range(20)}) == 2
    refused = ask(rt.url, "chat")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "adapter_not_loaded"
    assert "none of the 2 ready replica(s) of 'base'" in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"] and refused.headers.get("X-Request-Id")
    listed = {m["id"]: m for m in requests.get(rt.url + "/v1/models", timeout=10).json()["data"]}
    assert listed["sql"]["parent"] == "base" and listed["sql"]["llmgw"]["ready_replicas"] == 1
    assert listed["sql-lora"]["llmgw"]["alias_of"] == "sql" and listed["chat"]["llmgw"]["ready_replicas"] == 0
    one_model = requests.get(rt.url + "/v1/models/sql-lora", timeout=10).json()
    assert one_model["parent"] == "base"
    # Each adapter request counted under the adapter's own name (the alias too), for its spread;
    # the base's requests and the refused ones are no adapter's load.
    busy = rt.call(rt.router.adapter_inflight_seconds)
    assert set(busy) == {"sql"} and busy["sql"] > 0
    assert rt.call(lambda: rt.router.balancer.adapters.inflight("sql")) == 0


def test_the_adapter_counter_integrates_in_flight_over_time_and_forgets_names_the_catalog_dropped():
    from llmgwctl.router.adapterload import AdapterLoad
    now = [0.0]
    load = AdapterLoad(lambda: now[0])
    load.started("sql")
    now[0] = 2.0
    load.started("sql")
    load.started("chat")
    now[0] = 3.0
    load.finished("sql")
    assert load.inflight_seconds() == {"sql": 4.0, "chat": 1.0}
    now[0] = 5.0
    assert load.inflight_seconds() == {"sql": 6.0, "chat": 3.0}
    load.retain(["chat"])           # sql still has a request in flight: kept until it ends
    load.finished("sql")
    load.retain(["chat"])
    assert set(load.inflight_seconds()) == {"chat"}


def test_clients_cannot_reach_the_engines_adapter_routes(engines, routers):
    one = engines("base", "r1", "--max-loras", "2")
    rt = routers(make_router(catalog(BASE)))
    rt.set_endpoints([one.endpoint()])
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        refused = requests.post(rt.url + path, json={"lora_name": "evil", "lora_path": "/etc", "model": "base"},
                                timeout=10)
        assert refused.status_code == 404, refused.text
    cards = requests.get(one.url + "/v1/models", timeout=10).json()["data"]
    assert [c["id"] for c in cards] == ["base"]


def test_an_adapters_requests_are_counted_under_its_name_answered_or_refused(engines, routers):
    from prometheus_client.parser import text_string_to_metric_families

    one = engines("base", "r1", "--max-loras", "2")
    load(one, "sql")
    rt = routers(make_router(catalog(BASE)))
    rt.set_endpoints([dataclasses.replace(one.endpoint(), adapters=frozenset({"sql"}))])
    for model in ("sql", "sql-lora", "base", "chat"):
        ask(rt.url, model)
    page = requests.get(rt.url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(page) for s in f.samples]
    requests_by = {(s.labels["model"], s.labels["code"]): s.value for s in samples
                   if s.name == "llmgw_router_requests_total"}
    # Per adapter (an alias counts as its adapter), apart from its base: answered and refused alike.
    assert requests_by == {("sql", "200"): 2, ("base", "200"): 1, ("chat", "503"): 1}, requests_by
    durations = {s.labels["model"]: s.value for s in samples if s.name == "llmgw_router_request_duration_seconds_count"}
    assert durations == {"sql": 2, "base": 1}, durations
