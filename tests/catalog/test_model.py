import dataclasses

import pytest

from llmgwctl.catalog import Catalog, CatalogError, Live, Model, Profile, Replicas


def model(name, *aliases, engine="fake", **kw):
    return Model(name=name, aliases=aliases, profiles=(Profile(name="p", engine=engine, gpus=0),), **kw)


def test_resolve_by_name_and_alias():
    catalog = Catalog([model("qwen", "default", "q"), model("llama")])
    assert catalog.resolve("qwen").name == "qwen"
    assert catalog.resolve("default").name == "qwen"
    assert catalog.resolve("llama").name == "llama"
    assert catalog.resolve("nope") is None
    assert set(catalog.names()) == {"qwen", "default", "q", "llama"}


def test_catalog_and_its_parts_cannot_be_mutated():
    catalog = Catalog([model("qwen", "q")])
    with pytest.raises(AttributeError):
        catalog._models = ()
    with pytest.raises(AttributeError):
        catalog.version = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        catalog.models[0].name = "other"
    with pytest.raises(TypeError):
        catalog.engines["mine"] = None
    with pytest.raises(TypeError):
        catalog.models[0].profiles[0].env["X"] = "1"


def test_invalid_catalog_cannot_be_built():
    with pytest.raises(CatalogError) as info:
        Catalog([model("a", engine="nope"), model("b", "a"), model("c", replicas=Replicas(3, 1))])
    messages = [p.message for p in info.value.problems]
    assert any("'nope' is not one of" in m for m in messages)
    assert any("alias 'a' is already the name of model 'a'" in m for m in messages)
    assert any("min (3) is greater than max (1)" in m for m in messages)


def test_version_is_a_content_hash():
    a = Catalog([model("qwen", "q")])
    b = Catalog([model("qwen", "q")])
    c = Catalog([model("qwen", "q2")])
    assert a.version == b.version and a == b
    assert a.version != c.version


def test_ranked_profiles_best_first_written_order_breaks_ties():
    m = Model("m", profiles=(Profile("cpu", "llamacpp", gpus=0, priority=1), Profile("a", "vllm", priority=10),
                             Profile("b", "sglang", priority=10)))
    assert [p.name for p in m.ranked()] == ["a", "b", "cpu"]
    assert [p.name for p in m.profiles] == ["cpu", "a", "b"]


def test_live_swaps_whole_and_tells_listeners():
    first, second = Catalog([model("a")]), Catalog([model("b")])
    live = Live(first)
    seen = []
    live.subscribe(lambda old, new: seen.append((old.version, new.version)))
    taken = live.current  # a reader keeps what it took, whatever is swapped meanwhile
    assert live.swap(second) is first
    assert live.current is second and taken is first
    assert seen == [(first.version, second.version)]
