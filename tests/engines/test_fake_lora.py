"""The fake engine's LoRA adapters, spoken to as the agent speaks to vLLM: load, list, answer, unload, metrics."""
from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families

from .conftest import wait_healthy

MODEL = "fake-base"


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=10)


def ask(url: str, model: str) -> requests.Response:
    return post(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]})


def test_adapters_load_list_answer_as_themselves_and_unload(fake_engine, tmp_path):
    engine = fake_engine(MODEL, "--max-loras", "2")
    wait_healthy(engine.url)
    assert ask(engine.url, "sql").status_code == 404
    ok = post(engine.url, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(tmp_path)})
    assert ok.status_code == 200 and "added successfully" in ok.text
    again = post(engine.url, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(tmp_path)})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    cards = requests.get(engine.url + "/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("sql", MODEL)]
    tuned, base = ask(engine.url, "sql").json(), ask(engine.url, MODEL).json()
    assert tuned["model"] == "sql" and base["model"] == MODEL
    assert tuned["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    gone = post(engine.url, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert gone.status_code == 200
    assert post(engine.url, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
    assert ask(engine.url, "sql").status_code == 404


def test_a_missing_path_and_the_adapter_bound_are_refused_with_reasons(fake_engine, tmp_path):
    engine = fake_engine(MODEL, "--max-loras", "1", "--max-adapters", "1")
    wait_healthy(engine.url)
    missing = post(engine.url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and "No adapter found for" in missing.json()["error"]["message"]
    assert post(engine.url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "hub/a"}).status_code == 200
    full = post(engine.url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "hub/b"})
    assert full.status_code == 400 and "at most 1 adapters" in full.json()["error"]["message"]


def test_without_max_loras_there_are_no_adapter_routes(fake_engine):
    engine = fake_engine(MODEL)
    wait_healthy(engine.url)
    assert post(engine.url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "x"}).status_code == 404


def test_metrics_show_lora_requests_info_and_slot_hits(fake_engine):
    engine = fake_engine(MODEL, "--max-loras", "1")
    wait_healthy(engine.url)
    for name in ("a", "b"):
        assert post(engine.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"hub/{name}"}).ok
    for name in ("a", "a", "b", "a"):
        assert ask(engine.url, name).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(requests.get(engine.url + "/metrics", timeout=5).text)}
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    # One slot: a (miss), a (hit), b (miss, evicts a), a (miss).
    assert families["fake_lora_slot_hits"].samples[0].value == 1
    assert families["fake_lora_slot_misses"].samples[0].value == 3
