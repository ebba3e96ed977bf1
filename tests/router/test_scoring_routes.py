"""Rerank, score and tokenize through a real router to real fake engines: routed by the body's model.

Two models, each on its own engine, so which engine answered (x-llmgw-replica,
and the model the engine names) shows the request went by its model; the
same key rules, body limits and OpenAI-shaped errors hold as on embeddings.
"""
from __future__ import annotations

import pytest
import requests

from llmgwctl.router.auth import KeyFileWatcher, hash_key

from .harness import RouterThread, catalog, make_router, spawn_engine

RERANKER = "bge-reranker"
CHATTY = "small-chat"
KEY = "sk-rerank-only-" + "r" * 32
DOCS = ["the cat sat on the mat", "stock prices fell sharply", "a cat and a dog"]


@pytest.fixture(scope="module")
def served():
    engines = [spawn_engine(RERANKER, "rr1", "--max-model-len", "512"), spawn_engine(CHATTY, "ch1")]
    rt = RouterThread(make_router(catalog((RERANKER, ("rerank",)), (CHATTY, ("chat",))), max_body_bytes=64 * 1024))
    try:
        rt.set_endpoints([e.endpoint() for e in engines])
        yield rt
    finally:
        rt.close()
        for e in engines:
            e.kill()


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
@pytest.mark.parametrize("model, replica", [(RERANKER, "rr1"), ("rerank", "rr1"), ("chat", "ch1")])
def test_rerank_goes_to_the_model_the_body_names_at_each_path(served, path, model, replica):
    r = requests.post(served.url + path, json={"model": model, "query": "cat", "documents": DOCS, "top_n": 2},
                      timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == replica
    body = r.json()
    # The engine saw the canonical name (it 404s any other) and ranked the two cat documents first;
    # the client hears back the name it asked for, alias or not.
    assert body["model"] == model
    assert [x["index"] for x in body["results"]] == [2, 0]
    assert body["results"][0]["document"]["text"] == DOCS[2]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_by_model_one_to_many(served, path):
    r = requests.post(served.url + path, json={"model": "rerank", "text_1": "a cat", "text_2": ["a cat", "a dog"]},
                      timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == "rr1"
    scores = [d["score"] for d in r.json()["data"]]
    assert scores[0] == 1.0 and 0 < scores[1] < 1
    assert r.json()["usage"]["prompt_tokens"] > 0


def test_tokenize_and_detokenize_through_the_router(served):
    r = requests.post(served.url + "/tokenize", json={"model": "rerank", "prompt": "héllo"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == "rr1"
    tokens = r.json()
    assert tokens["count"] == len("héllo".encode()) and tokens["max_model_len"] == 512
    back = requests.post(served.url + "/detokenize", json={"model": RERANKER, "tokens": tokens["tokens"]},
                         timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": "héllo"}
    # Chat messages, on the other model.
    r = requests.post(served.url + "/tokenize", json={"model": "chat", "messages": [{"role": "user", "content": "x"}]},
                      timeout=30)
    assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "ch1" and r.json()["max_model_len"] == 4096


def _error(r: requests.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert "x-llmgw-replica" not in r.headers and r.headers.get("X-Request-Id")
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    return err


@pytest.mark.parametrize("path", ["/v1/rerank", "/score", "/tokenize", "/detokenize"])
def test_the_routers_own_errors_are_openai_shaped(served, path):
    url = served.url + path
    _error(requests.post(url, json={"query": "x", "documents": ["y"]}, timeout=30), 400, "missing_model")
    err = _error(requests.post(url, json={"model": "rerankr", "prompt": "x"}, timeout=30), 404, "model_not_found")
    assert "'rerank'" in err["message"]
    _error(requests.post(url, data=b"{not json", timeout=30), 400, "invalid_json")
    _error(requests.post(url, json={"model": "rerank", "pad": "x" * 70_000}, timeout=30), 413, "request_too_large")
    assert requests.get(url, timeout=30).status_code == 405


def test_an_engines_own_refusal_comes_back_as_it_said(served):
    r = requests.post(served.url + "/detokenize", json={"model": "rerank", "tokens": [999]}, timeout=30)
    assert r.status_code == 400 and r.headers["x-llmgw-replica"] == "rr1"
    assert r.json()["error"]["param"] == "tokens"


def test_a_key_reaches_only_its_models_on_these_routes(served, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: rr, sha256: {hash_key(KEY)}, models: ['rerank*', 'bge-*'], rpm: 6000}}\n")
    served.call(KeyFileWatcher(keys, served.router.set_api_keys).load_initial)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        ok = requests.post(served.url + "/v2/rerank", headers=auth,
                           json={"model": "rerank", "query": "cat", "documents": DOCS}, timeout=30)
        assert ok.status_code == 200 and ok.headers["x-llmgw-replica"] == "rr1"
        _error(requests.post(served.url + "/tokenize", headers=auth, json={"model": "chat", "prompt": "x"},
                             timeout=30), 403, "model_not_permitted")
        assert requests.post(served.url + "/score", json={"model": "rerank", "text_1": "a", "text_2": "b"},
                             timeout=30).status_code == 401
    finally:
        served.call(served.router.set_api_keys, None)
