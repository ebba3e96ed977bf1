"""A model's `fallbacks`: what the catalog accepts, what it refuses (with file:line), and the chains it makes."""
import pytest
from click.testing import CliRunner

from llmgwctl.catalog import CatalogError, Live, load_dir, load_document, load_text
from llmgwctl.catalog.fallbacks import MAX_CHAIN, chains
from llmgwctl.catalog.watcher import CatalogWatcher
from llmgwctl.cli import main

from .conftest import HEADER


def model(name, *fallbacks, aliases=()):
    out = f"  - name: {name}\n"
    if aliases:
        out += f"    aliases: [{', '.join(aliases)}]\n"
    if fallbacks:
        out += f"    fallbacks: [{', '.join(fallbacks)}]\n"
    return out + "    profiles: [{engine: fake, gpus: 0}]\n"


def doc(*models):
    return HEADER + "models:\n" + "".join(models)


def problems(text, file="<input>"):
    with pytest.raises(CatalogError) as exc:
        load_text(text, file)
    return [str(p) for p in exc.value.problems]


def test_fallbacks_by_name_or_alias_make_chains_of_canonical_names_depth_first():
    catalog = load_text(doc(model("big", "mid-alias", "tiny"), model("mid", "small", aliases=["mid-alias"]),
                            model("small"), model("tiny", "small")))
    assert catalog.resolve("big").fallbacks == ("mid-alias", "tiny")       # as written
    # mid's own fallback comes right after mid; small is tried once, not again after tiny.
    assert chains(catalog) == {"big": ("mid", "small", "tiny"), "mid": ("small",), "tiny": ("small",)}
    assert catalog.to_dict()["models"][0]["fallbacks"] == ["mid-alias", "tiny"]
    assert "fallbacks" not in catalog.to_dict()["models"][2]
    # A catalog without fallbacks keeps its version; one that adds them changes it.
    plain = load_text(doc(model("big"), model("small")))
    assert load_text(doc(model("big", "small"), model("small"))).version != plain.version
    assert load_document(catalog.to_dict()) == catalog


def test_unknown_self_and_twice_listed_names_are_refused_at_their_line():
    text = doc(model("a", "b", "nope", "a-too", "b", "bee", aliases=["a-too"]), model("b", aliases=["bee"]))
    assert problems(text, "cat.yaml") == [
        "cat.yaml:6:20: models[0].fallbacks[1]: 'nope' is not a model or alias of the catalog; "
        "a fallback names another model",
        "cat.yaml:6:26: models[0].fallbacks[2]: 'a-too' (an alias of 'a') is this model itself; "
        "a model cannot fall back to itself",
        "cat.yaml:6:33: models[0].fallbacks[3]: 'b' is model 'b', already listed at fallbacks[0]",
        "cat.yaml:6:36: models[0].fallbacks[4]: 'bee' is model 'b', already listed at fallbacks[0]",
    ]
    assert problems(doc(model("a", "a")), "x.yaml") == [
        "x.yaml:5:17: models[0].fallbacks[0]: 'a' is this model itself; a model cannot fall back to itself"]


def test_a_cycle_is_refused_once_at_the_entry_that_closes_it_naming_the_loop():
    assert problems(doc(model("a", "b"), model("b", "a")), "c.yaml") == [
        "c.yaml:8:17: models[1].fallbacks[0]: 'a' makes a cycle of fallbacks: a -> b -> a; "
        "a chain of fallbacks must end"]
    # Through an alias, three long, with a branch that is fine.
    found = problems(doc(model("a", "ok", "b"), model("b", "c"), model("c", "first", aliases=["cee"]),
                         model("ok"), model("x", "a", aliases=["first"])))
    assert len(found) == 1
    assert "models[4].fallbacks[0]: 'a' makes a cycle of fallbacks: a -> b -> c -> x -> a" in found[0]


def test_a_cycle_across_files_points_into_each_file(tmp_path):
    (tmp_path / "one.yaml").write_text(doc(model("a", "b")))
    (tmp_path / "two.yaml").write_text(doc(model("b", "a")))
    with pytest.raises(CatalogError) as exc:
        load_dir(tmp_path)
    assert [str(p) for p in exc.value.problems] == [
        f"{tmp_path}/two.yaml:5:17: models[0].fallbacks[0]: 'a' makes a cycle of fallbacks: a -> b -> a; "
        "a chain of fallbacks must end"]


def test_the_schema_bounds_the_list_and_its_names():
    too_many = [f"m{i}" for i in range(9)]
    text = doc(model("a", *too_many), *(model(n) for n in too_many))
    assert any("models[0].fallbacks" in p and "8" in p for p in problems(text))
    assert any("models[0].fallbacks[0]" in p for p in problems(doc(model("a", "'-bad'"))))
    found = problems(doc(model("a").replace("    profiles", "    fallbacks: b\n    profiles"), model("b")))
    assert any("models[0].fallbacks" in p for p in found)


def test_a_long_chain_is_cut_at_max_chain_and_a_deep_one_is_checked_without_recursion():
    names = [f"m{i}" for i in range(MAX_CHAIN + 5)]
    text = doc(*(model(n, names[i + 1]) if i + 1 < len(names) else model(n) for i, n in enumerate(names)))
    assert chains(load_text(text))["m0"] == tuple(names[1:MAX_CHAIN + 1])
    deep = [f"d{i}" for i in range(3000)]
    text = doc(*(model(n, deep[(i + 1) % len(deep)]) for i, n in enumerate(deep)))
    found = problems(text)
    assert len(found) == 1 and "d0 -> d1 -> d2" in found[0] and found[0].endswith("must end")


def test_catalog_validate_refuses_a_cycle_with_file_line_and_exit_1(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(doc(model("a", "b"), model("b", "a")))
    result = CliRunner().invoke(main, ["catalog", "validate", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{path}:8:17: models[1].fallbacks[0]: 'a' makes a cycle of fallbacks: a -> b -> a" in result.output
    path.write_text(doc(model("a", "b"), model("b")))
    assert CliRunner().invoke(main, ["catalog", "validate", str(tmp_path)]).exit_code == 0


def test_a_live_reload_that_makes_a_cycle_is_rejected_and_the_last_good_catalog_stays(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text(doc(model("a", "b"), model("b")))
    live = Live()
    watcher = CatalogWatcher(tmp_path, live)
    assert watcher.reload().swapped
    good = live.current
    path.write_text(doc(model("a", "b"), model("b", "nope")))
    outcome = watcher.reload()
    assert outcome.rejection is not None and live.current is good
    assert f"{path}:8:17: models[1].fallbacks[0]: 'nope' is not a model" in str(outcome.rejection.problems[0])
    path.write_text(doc(model("a", "b"), model("b", "a")))
    outcome = watcher.reload()
    assert outcome.rejection is not None and live.current is good
    assert "a -> b -> a" in str(outcome.rejection.problems[0])
    assert chains(live.current) == {"a": ("b",)}
