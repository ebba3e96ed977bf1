"""Profiles spanning nodes: `nodes` and `parallel`, as the loader reads, checks and writes them back."""
import json
import re

import pytest

from llmgwctl.catalog import Catalog, CatalogError, Model, Profile, load_document, load_text
from llmgwctl.catalog.multinode import DEFAULT_PARALLEL, MAX_NODES, PARALLEL_MODES

from .conftest import HEADER

TEXT = HEADER + """
models:
  - name: big
    profiles:
      - {name: two, engine: vllm, gpus: 8, nodes: 2, parallel: tensor}
      - {name: one, engine: vllm, gpus: 8}
"""


def messages(text: str) -> list[str]:
    with pytest.raises(CatalogError) as info:
        load_text(text)
    return [f"{'.'.join(map(str, p.path))}: {p.message}" for p in info.value.problems]


def test_nodes_and_parallel_as_written_with_one_node_the_default():
    catalog = load_text(TEXT)
    two, one = catalog.resolve("big").profiles
    assert (two.nodes, two.gpus, two.parallel, two.parallelism) == (2, 8, "tensor", "tensor")
    assert (one.nodes, one.parallel, one.parallelism) == (1, None, None)


def test_parallel_defaults_to_pipeline_across_nodes():
    catalog = load_text(TEXT.replace(", parallel: tensor", ""))
    two = catalog.resolve("big").profiles[0]
    assert two.parallel is None and two.parallelism == DEFAULT_PARALLEL == "pipeline"
    assert "parallel" not in catalog.to_dict()["models"][0]["profiles"][0]


@pytest.mark.parametrize("mode", PARALLEL_MODES)
def test_every_mode_round_trips_through_the_document_form(mode):
    catalog = load_text(TEXT.replace("parallel: tensor", f"parallel: {mode}"))
    again = load_document(json.loads(json.dumps(catalog.to_dict())))
    assert again == catalog and again.resolve("big").profiles[0].parallelism == mode


def test_a_one_node_catalog_keeps_its_version_and_document():
    # Written only when not the default: a catalog that does not span nodes
    # hashes as it did before the fields existed, so nothing is replaced on upgrade.
    plain = load_text(TEXT.replace("      - {name: two, engine: vllm, gpus: 8, nodes: 2, parallel: tensor}\n", ""))
    explicit = load_text(TEXT.replace("{name: two, engine: vllm, gpus: 8, nodes: 2, parallel: tensor}",
                                      "{name: two, engine: vllm, gpus: 8, nodes: 1}"))
    assert plain.to_dict()["models"][0]["profiles"] == [
        {"name": "one", "engine": "vllm", "gpus": 8, "priority": 0, "weight": 1.0}]
    assert "nodes" not in explicit.to_dict()["models"][0]["profiles"][0]
    assert explicit.version != plain.version     # one profile more, not a field more
    assert Catalog([Model("m", (Profile("p", "vllm"),))]).version == \
        Catalog([Model("m", (Profile("p", "vllm", nodes=1),))]).version


@pytest.mark.parametrize("bad, expected", [
    ("nodes: 0", r"profiles\.0\.nodes: .*1"),
    (f"nodes: {MAX_NODES + 1}", r"profiles\.0\.nodes: .*64"),
    ("nodes: 1.5", r"profiles\.0\.nodes"),
    ("nodes: true", r"profiles\.0\.nodes"),
    ("nodes: '2'", r"profiles\.0\.nodes"),
    ("nodes: 2, parallel: expert", r"profiles\.0\.parallel: .*tensor.*pipeline.*data"),
    ("nodes: 2, parallel: Tensor", r"profiles\.0\.parallel"),
])
def test_the_schema_holds_nodes_and_parallel_to_their_values(bad, expected):
    text = HEADER + f"models:\n  - name: m\n    profiles: [{{engine: vllm, {bad}}}]\n"
    found = messages(text)
    assert any(re.search(expected, m) for m in found), found


def test_parallel_on_one_node_says_what_it_means():
    found = messages(HEADER + "models:\n  - name: m\n    profiles: [{engine: vllm, parallel: data}]\n")
    assert found == ["models.0.profiles.0.parallel: parallel says how a model is split across nodes, and this "
                     "profile runs on one (nodes: 1); remove it, or give the profile nodes: 2 or more"]


@pytest.mark.parametrize("engine", ["llamacpp", "mine"])
def test_only_engines_that_launch_across_nodes_may_span_them(engine):
    text = HEADER + f"""
models:
  - name: m
    profiles: [{{engine: {engine}, nodes: 2}}]
engines:
  mine:
    command: [mine, "{{source}}", --port, "{{port}}"]
"""
    found = messages(text)
    assert found == [f"models.0.profiles.0.nodes: engine {engine!r} cannot run one replica across nodes "
                     "(engines that can: vllm, sglang, fake)"]


def test_sglang_spans_nodes_by_tensor_or_pipeline_but_not_data():
    ok = HEADER + "models:\n  - name: m\n    profiles: [{engine: sglang, nodes: 2, parallel: tensor}]\n"
    assert load_text(ok).resolve("m").profiles[0].parallelism == "tensor"
    found = messages(HEADER + "models:\n  - name: m\n    profiles: [{engine: sglang, nodes: 2, parallel: data}]\n")
    assert found == ["models.0.profiles.0.parallel: engine 'sglang' splits a model across nodes by tensor or "
                     "pipeline, not data"]


def test_a_group_takes_whole_gpus():
    found = messages(HEADER + "models:\n  - name: m\n    profiles: [{engine: vllm, nodes: 2, gpu_memory: 20GiB}]\n")
    assert found == ["models.0.profiles.0.gpu_memory: a profile spanning nodes takes whole GPUs on each; "
                     "remove gpu_memory, or give the profile nodes: 1"]


def test_problems_carry_the_line_of_the_profile():
    with pytest.raises(CatalogError) as info:
        load_text(TEXT.replace("engine: vllm, gpus: 8, nodes: 2", "engine: llamacpp, gpus: 8, nodes: 2"), "c.yaml")
    (problem,) = info.value.problems
    assert (problem.file, problem.line) == ("c.yaml", 7)     # the profile's line
    assert str(problem).startswith("c.yaml:7:")


def test_a_catalog_built_in_code_is_held_to_the_same_rules():
    with pytest.raises(CatalogError, match="from 1 to 64"):
        Catalog([Model("m", (Profile("p", "vllm", nodes=0),))])
    with pytest.raises(CatalogError, match="is not one of tensor, pipeline, data"):
        Catalog([Model("m", (Profile("p", "vllm", nodes=2, parallel="ring"),))])
    assert Catalog([Model("m", (Profile("p", "fake", gpus=0, nodes=3),))]).models[0].profiles[0].parallelism == \
        "pipeline"
