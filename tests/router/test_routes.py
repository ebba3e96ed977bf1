"""The route table: only the routes llmgw documents, and those a catalog's engines add, reach an engine.

Table-driven, against a real router on loopback and a real fake engine that
logs every POST it gets (so "the engine never saw it" is read off its log,
not assumed). The fake engine serves `/reset_prefix_cache`, as vLLM does: a
router that proxied by path would reach it.
"""
from __future__ import annotations

import json

import pytest
import requests

from llmgwctl.catalog import Catalog, CatalogError, EngineSpec, Model, Profile, load_text
from llmgwctl.contracts import Endpoint
from llmgwctl.router import routes
from llmgwctl.router.shapes import ANTHROPIC, OPENAI

from .harness import make_router, wait_until

MODEL = "routes-model"
SCORER = "routes-scorer"        # its engine ("scorer", catalog-defined) lists /v1/pooling
MIXED = "routes-mixed"          # one profile on the scorer, one on plain fake: /v1/pooling is not for it
ENGINE = EngineSpec("scorer", command=("fake-scorer", "--port", "{port}"), routes=("/v1/pooling", "/v1/classify"))


def _model(name: str, *engines: str) -> Model:
    return Model(name=name, aliases=(name + "-alias",), source=f"org/{name}",
                 profiles=tuple(Profile(name=f"p{i}", engine=e, gpus=0) for i, e in enumerate(engines)))


CATALOG = Catalog([_model(MODEL, "fake"), _model(SCORER, "scorer"), _model(MIXED, "scorer", "fake")],
                  {"scorer": ENGINE})
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (method, path, model, body beyond the model, expected status, whether the engine gets it)
CASES = [
    ("POST", "/v1/chat/completions", MODEL, CHAT, 200, True),
    ("POST", "/v1/chat/completions", MODEL + "-alias", CHAT, 200, True),
    ("POST", "/v1/completions", MODEL, {"prompt": "hi", "max_tokens": 2}, 200, True),
    ("POST", "/v1/embeddings", MODEL, {"input": ["a"]}, 200, True),
    # Rerank, score and the tokenizer: in the table, for every model (the fake engine serves them all).
    ("POST", "/v1/rerank", MODEL, {"query": "a", "documents": ["a", "b"]}, 200, True),
    ("POST", "/rerank", MODEL + "-alias", {"query": "a", "documents": ["a"]}, 200, True),
    ("POST", "/v2/rerank", MODEL, {"query": "a", "documents": ["a"]}, 200, True),
    ("POST", "/v1/score", MODEL, {"text_1": "a", "text_2": "b"}, 200, True),
    ("POST", "/score", MODEL + "-alias", {"text_1": "a", "text_2": "b"}, 200, True),
    ("POST", "/tokenize", MODEL, {"prompt": "a b"}, 200, True),
    ("POST", "/detokenize", MODEL, {"tokens": [97]}, 200, True),
    ("POST", "/v1/responses", MODEL, {"input": "hi", "max_output_tokens": 2}, 200, True),
    # A stored response's routes: an id this router never saw is its own 404, never an engine's.
    ("GET", "/v1/responses/resp_x", MODEL, None, 404, False),
    ("DELETE", "/v1/responses/resp_x", MODEL, None, 404, False),
    ("POST", "/v1/responses/resp_x/cancel", MODEL, {}, 404, False),
    ("PUT", "/v1/responses/resp_x", MODEL, None, 405, False),
    ("POST", "/v1/messages", MODEL + "-alias", {"max_tokens": 2, "messages": CHAT["messages"]}, 200, True),
    ("POST", "/v1/messages/count_tokens", MODEL, {"messages": CHAT["messages"]}, 200, True),
    # Engine-admin routes: never reachable, whatever model the body names.
    ("POST", "/v1/load_lora_adapter", MODEL, {"lora_name": "x", "lora_path": "/etc"}, 404, False),
    ("POST", "/v1/unload_lora_adapter", MODEL, {"lora_name": "x"}, 404, False),
    ("POST", "/reset_prefix_cache", MODEL, {}, 404, False),
    ("POST", "/sleep", MODEL, {}, 404, False),
    ("POST", "/wake_up", MODEL, {}, 404, False),
    ("POST", "/collective_rpc", MODEL, {"method": "x"}, 404, False),
    ("POST", "/v1/shutdown", MODEL, {}, 404, False),
    # Unknown routes, and a catalog route for a model whose engines do not all list it.
    ("POST", "/v1/pooling", MODEL, {"input": "a"}, 404, False),
    ("POST", "/v1/pooling", MIXED, {"input": "a"}, 404, False),
    ("POST", "/v1/tokenize", MODEL, {"prompt": "a"}, 404, False),     # vLLM has none under /v1/
    ("POST", "/v1/nothing/here", MODEL, {}, 404, False),
    ("GET", "/v1/embeddings", MODEL, None, 405, False),
    # A catalog-added route: proxied (the fake engine has no /v1/pooling, so its own 404 comes back).
    ("POST", "/v1/pooling", SCORER, {"input": "a"}, 404, True),
    ("POST", "/v1/classify", SCORER + "-alias", {"input": "a"}, 404, True),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from .harness import RouterThread, spawn_engine

    log = tmp_path_factory.mktemp("routes") / "engine.log"
    engine = spawn_engine(MODEL, "rt1", "--log-requests", stderr=log)
    rt = RouterThread(make_router(CATALOG))
    # One engine behind every model: what differs is only what the catalog says their engines serve.
    rt.set_endpoints([Endpoint(replica_id=f"rt-{m}", model=m, profile="p0", engine="fake", url=engine.url)
                      for m in (MODEL, SCORER, MIXED)])
    try:
        yield rt, log
    finally:
        rt.close()
        engine.kill()


def _engine_posts(log) -> list[str]:
    return [line.split(": ", 1)[1].split(" x-request-id")[0] for line in log.read_text().splitlines()
            if line.startswith("fake engine")]


@pytest.mark.parametrize("method, path, model, extra, status, reaches", CASES,
                         ids=[f"{c[0]} {c[1]} {c[2]}" for c in CASES])
def test_a_route_is_proxied_only_when_the_table_or_the_catalog_has_it(served, method, path, model, extra, status,
                                                                      reaches):
    rt, log = served
    before = len(_engine_posts(log))
    body = None if extra is None else {"model": model, **extra}
    r = requests.request(method, rt.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert ("x-llmgw-replica" in r.headers) == reaches, r.headers
    if not reaches:
        error = r.json()["error"]
        # The OpenAI shape: every route refused here is outside the Messages routes, which answer in Anthropic's.
        assert {"message", "type", "code"} <= set(error) and r.headers["Content-Type"].startswith("application/json")
        assert r.headers.get("X-Request-Id")
        # Nothing reached the engine: a sentinel request that does is the next line of its log.
        requests.post(rt.url + "/v1/completions", json={"model": MODEL, "prompt": "sentinel", "max_tokens": 1},
                      timeout=30).raise_for_status()
        wait_until(lambda: len(_engine_posts(log)) > before, timeout=10, what="the sentinel at the engine")
        assert _engine_posts(log)[before:] == ["POST /v1/completions"]
    else:
        wait_until(lambda: len(_engine_posts(log)) > before, timeout=10, what="the request at the engine")
        assert _engine_posts(log)[before:] == [f"POST {path}"]


def test_an_unknown_route_is_an_openai_shaped_404_naming_it_shortened(served):
    rt, _ = served
    r = requests.post(rt.url + "/v1/" + "x" * 5000, json={"model": MODEL}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert len(r.json()["error"]["message"]) < 300, r.json()


def test_the_table_holds_the_documented_apis_and_no_admin_route():
    assert [r.path for r in routes.TABLE] == [
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank",
        "/v1/score", "/score", "/tokenize", "/detokenize", "/v1/responses", "/v1/responses/{id}",
        "/v1/responses/{id}/cancel", "/v1/responses/{id}/input_items", "/v1/messages", "/v1/messages/count_tokens"]
    by_model = [r for r in routes.TABLE if not r.by_response]
    assert all(r.methods == ("POST",) and r.model_key == "model" for r in by_model)
    streams = {r.path for r in by_model if r.streams}
    assert streams == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
    chat, completions, *rest, responses, messages, count = by_model
    assert messages.prompt is not None and count.prompt is None
    assert messages.error_shape is count.error_shape is ANTHROPIC
    assert chat.prompt is not None and chat.prompt({"messages": [{"role": "user", "content": "x"}]}) == "<|user|>\nx\n"
    assert completions.prompt is not None and completions.prompt({"prompt": "once"}) == "once"
    assert all(r.prompt is None and r.error_shape is OPENAI and not r.binds for r in rest)
    # Responses: the instructions as a system message, then the input, as a chat's prompt reads.
    assert responses.prompt is not None and responses.binds
    assert responses.prompt({"instructions": "sys", "input": "x"}) == "<|system|>\nsys\n<|user|>\nx\n"
    assert responses.prompt({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                                       {"type": "function_call_output", "output": "42"}]}) == \
        "<|user|>\na\n<|function_call_output|>\n\n"
    assert responses.prompt({"input": 5}) is None
    # A stored response's routes: by the id in the path, never by a model.
    stored = {r.path: r.methods for r in routes.TABLE if r.by_response}
    assert stored == {"/v1/responses/{id}": ("GET", "DELETE"), "/v1/responses/{id}/cancel": ("POST",),
                      "/v1/responses/{id}/input_items": ("GET",)}


def test_a_catalog_route_is_for_the_models_whose_every_engine_lists_it():
    view = routes.View(CATALOG)
    assert set(view.paths()) == {"/v1/pooling", "/v1/classify"}
    score = view.routes["/v1/pooling"]
    assert view.allows(score, SCORER) and not view.allows(score, MIXED) and not view.allows(score, MODEL)
    assert all(view.allows(r, MODEL) for r in routes.TABLE)


ENGINE_YAML = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: m
    profiles: [{{name: p, engine: mine, gpus: 0}}]
engines:
  mine:
    command: [serve-it, "{{port}}"]
    routes: {routes}
"""


@pytest.mark.parametrize("route, why", [
    ("/v1/load_lora_adapter", "engine-admin"),
    ("/v1/unload_lora_adapter", "engine-admin"),
    ("/v1/sleep", "engine-admin"),
    ("/v1/reset_prefix_cache", "engine-admin"),
    ("/v1/models", "the router's own"),
    ("/score", "not a client route"),
    ("/v1/../admin", "not a client route"),
    ("/v1/score?x=1", "not a client route"),
])
def test_the_catalog_refuses_admin_and_malformed_engine_routes(route, why):
    with pytest.raises(CatalogError) as err:
        load_text(ENGINE_YAML.format(routes=f"['{route}']"), "cat.yaml")
    assert why in str(err.value) and "engines.mine.routes[0]" in str(err.value), str(err.value)


def test_engine_routes_load_and_round_trip():
    cat = load_text(ENGINE_YAML.format(routes="[/v1/score, /v1/rerank]"), "cat.yaml")
    assert cat.engines["mine"].routes == ("/v1/score", "/v1/rerank")
    assert cat.to_dict()["engines"]["mine"]["routes"] == ["/v1/score", "/v1/rerank"]
    assert load_text(json.dumps(cat.to_dict())).version == cat.version
