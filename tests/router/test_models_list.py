"""/v1/models and /v1/models/{id} with what clients read: aliases, whether loaded, context length, parent.

A real router and real fake engines, each reporting its own max_model_len
on its /v1/models card, as vLLM does: the router asks each as it joins.
"""
from __future__ import annotations

import openai
import pytest
import requests

from llmgwctl.catalog import Model, Profile
from llmgwctl.contracts import ModelCondition, ModelState
from llmgwctl.router.auth import KeyFileWatcher, hash_key

from .harness import catalog, make_router, wait_until

MODEL = "ctx-model"
ASLEEP = "asleep-model"
OTHER = "secret-llm"
KEY = "sk-ctx-" + "k" * 32
FIELDS = {"id", "object", "created", "owned_by", "aliases", "status", "context_length", "max_model_len", "parent",
          "llmgw"}


def _listed(rt, headers=None) -> dict[str, dict]:
    raw = requests.get(rt.url + "/v1/models", headers=headers, timeout=10)
    assert raw.status_code == 200, raw.text
    return {m["id"]: m for m in raw.json()["data"]}


@pytest.fixture
def setup(engines, routers):
    big = engines(MODEL, "c1", "--max-model-len", "8192")
    # The catalog says a length for two: the engine's own word wins for the one it runs.
    said = [Model(name=n, aliases=a, source=f"org/{n}", profiles=(Profile(name="default", engine="fake", gpus=0),),
                  context_length=length)
            for n, a, length in ((MODEL, ("ctx", "ctx-default"), 999), (ASLEEP, (), None), (OTHER, ("o",), 1234))]
    rt = routers(make_router(catalog(*said)))
    rt.set_endpoints([big.endpoint()])
    return rt, big, engines


def test_each_entry_has_its_aliases_status_and_the_context_length_its_engine_said(setup):
    rt, big, engines = setup
    wait_until(lambda: _listed(rt)[MODEL]["context_length"] == 8192, timeout=30, what="the length learned")
    listed = _listed(rt)
    assert set(listed) == {MODEL, "ctx", "ctx-default", ASLEEP, OTHER, "o"}
    assert all(set(m) == FIELDS for m in listed.values()), listed
    entry = listed[MODEL]
    assert (entry["object"], entry["owned_by"], entry["parent"]) == ("model", "llmgw", None)
    assert isinstance(entry["created"], int)
    assert entry["aliases"] == ["ctx", "ctx-default"] and entry["status"] == "loaded"
    assert entry["max_model_len"] == 8192
    # An alias is an entry of its own, with its model's facts.
    alias = listed["ctx"]
    assert (alias["status"], alias["context_length"], alias["aliases"]) == ("loaded", 8192, ["ctx", "ctx-default"])
    assert alias["llmgw"]["alias_of"] == MODEL
    # Never started: nothing known of its length, unless the catalog says one.
    assert (listed[ASLEEP]["status"], listed[ASLEEP]["context_length"]) == ("unloaded", None)
    assert (listed["o"]["context_length"], listed["o"]["max_model_len"]) == (1234, 1234)
    # The openai client reads the list and one entry, extra fields kept.
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    one = client.models.retrieve("ctx")
    assert one.id == "ctx" and one.model_extra["context_length"] == 8192
    assert requests.get(rt.url + "/v1/models/ctx", timeout=10).json() == alias


def test_a_model_takes_its_smallest_replica_and_keeps_it_while_scaled_to_zero(setup):
    rt, big, engines = setup
    small = engines(MODEL, "c2", "--max-model-len", "2048")
    rt.set_endpoints([big.endpoint(), small.endpoint()])
    wait_until(lambda: _listed(rt)[MODEL]["context_length"] == 2048, timeout=30, what="the smaller length")
    rt.set_endpoints([])
    entry = _listed(rt)[MODEL]
    assert (entry["status"], entry["context_length"]) == ("unloaded", 2048)


def test_status_follows_what_the_controller_says(setup):
    rt, *_ = setup
    rt.call(rt.router.set_model_states, [ModelState(ASLEEP, ModelCondition.STARTING),
                                         ModelState(OTHER, ModelCondition.UNPLACEABLE, "no GPU fits", retry=False)])
    listed = _listed(rt)
    assert (listed[ASLEEP]["status"], listed[OTHER]["status"], listed["o"]["status"]) == \
        ("loading", "unplaceable", "unplaceable")
    rt.call(rt.router.set_model_states, [])
    assert _listed(rt)[ASLEEP]["status"] == "unloaded"


def test_a_restricted_key_sees_and_retrieves_only_its_models(setup, tmp_path):
    rt, *_ = setup
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: ctx, sha256: {hash_key(KEY)}, models: ['ctx*'], rpm: 6000}}\n")
    rt.call(KeyFileWatcher(keys, rt.router.set_api_keys).load_initial)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert set(_listed(rt, auth)) == {MODEL, "ctx", "ctx-default"}
    assert requests.get(rt.url + "/v1/models/ctx", headers=auth, timeout=10).json()["id"] == "ctx"
    # Outside its patterns, existing or not: the same 404, which names neither.
    hidden = [requests.get(rt.url + f"/v1/models/{name}", headers=auth, timeout=10) for name in (OTHER, "secret-xyz")]
    assert [r.status_code for r in hidden] == [404, 404]
    assert [r.json()["error"]["code"] for r in hidden] == ["model_not_found"] * 2
    assert hidden[0].json()["error"]["message"].replace(OTHER, "X") == \
        hidden[1].json()["error"]["message"].replace("secret-xyz", "X")
    assert OTHER not in hidden[1].text and "'o'" not in hidden[0].text
    assert requests.get(rt.url + "/v1/models", timeout=10).status_code == 401
