"""Properties over many generated catalogs: round trips are exact, and bad input only ever gives CatalogError."""
import json

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgwctl.catalog import Catalog, CatalogError, load_text
from llmgwctl.catalog.diff import diff
from llmgwctl.catalog.engine_env import env_refusal
from llmgwctl.cli import main

names = st.from_regex(r"[a-z][a-z0-9.-]{0,12}", fullmatch=True)
arg = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8) | st.integers(-10**6, 10**6)


@st.composite
def profile_doc(draw, name):
    doc = {"name": name, "engine": draw(st.sampled_from(["vllm", "sglang", "llamacpp", "fake"]))}
    if draw(st.booleans()):
        doc["pool"] = draw(names)
    if draw(st.booleans()):
        doc["source"] = draw(names)
    for key, strategy in (("gpus", st.integers(0, 8)), ("priority", st.integers(-5, 20)),
                          ("weight", st.floats(0.01, 100, allow_nan=False)),
                          ("args", st.lists(arg, max_size=4)),
                          ("env", st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True)
                                                  .filter(lambda key: env_refusal(key) is None), arg, max_size=3))):
        if draw(st.booleans()):
            doc[key] = draw(strategy)
    return doc


@st.composite
def catalog_doc(draw):
    all_names = draw(st.lists(names, min_size=0, max_size=12, unique=True))
    models, i = [], 0
    while i < len(all_names):
        n_aliases = draw(st.integers(0, min(2, len(all_names) - i - 1)))
        name, aliases = all_names[i], all_names[i + 1:i + 1 + n_aliases]
        i += 1 + n_aliases
        doc = {"name": name}
        if aliases:
            doc["aliases"] = aliases
        if draw(st.booleans()):
            lo = draw(st.integers(0, 3))
            doc["replicas"] = draw(st.sampled_from([lo, {"min": lo, "max": lo + draw(st.integers(1, 3))}]))
        if draw(st.booleans()):
            doc["idle_timeout"] = draw(st.sampled_from(["30s", "15m", "1h30m", "2d", 90, "250ms"]))
        profile_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
        doc["profiles"] = [draw(profile_doc(n)) for n in profile_names]
        models.append(doc)
    return {"apiVersion": "llmgw/v1", "kind": "Catalog", "models": models}


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalog_doc())
def test_accepted_catalogs_round_trip_through_show_and_diff(tmp_path_factory, doc):
    catalog = load_text(yaml.safe_dump(doc))
    again = load_text(yaml.safe_dump(catalog.to_dict()))
    assert again == catalog and again.version == catalog.version
    assert not diff(catalog, again)

    folder = tmp_path_factory.mktemp("c")
    (folder / "c.yaml").write_text(yaml.safe_dump(doc))
    runner = CliRunner()
    for fmt, parse in (("yaml", yaml.safe_load), ("json", json.loads)):
        shown = runner.invoke(main, ["catalog", "show", "-o", fmt, str(folder)])
        assert shown.exit_code == 0, shown.output
        assert load_text(yaml.safe_dump(parse(shown.output))) == catalog
    same = runner.invoke(main, ["catalog", "diff", str(folder), str(folder / "c.yaml")])
    assert same.exit_code == 0 and "no changes" in same.output


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


def must_be_valid_or_catalog_error(text):
    try:
        assert isinstance(load_text(text), Catalog)
    except CatalogError as exc:
        assert exc.problems and all(str(p) for p in exc.problems)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_never_raises_anything_but_catalog_error(text):
    must_be_valid_or_catalog_error(text)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_but_catalog_error(data):
    must_be_valid_or_catalog_error(data)


@settings(max_examples=300, deadline=None)
@given(yaml_values)
def test_arbitrary_yaml_structures_never_raise_anything_but_catalog_error(value):
    must_be_valid_or_catalog_error(yaml.safe_dump(value))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalog_doc(), st.data())
def test_catalogs_with_a_random_field_replaced_never_raise_anything_else(doc, data):
    # Near-valid documents reach deeper into the loader than random text does.
    node, path = doc, []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    if path:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = data.draw(yaml_values)
    must_be_valid_or_catalog_error(yaml.safe_dump(doc))
