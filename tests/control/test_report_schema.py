"""An agent report's schema check (issue 19): a compiled check for valid reports, jsonschema's problems for the rest.

A valid report is passed by fastjsonschema's compiled check of the same
schema; one it refuses is checked by jsonschema, whose problems are named.
The compiled check must never pass what jsonschema refuses.
"""
from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgwctl.control import schemas


def report():
    replica = {"id": "r1", "spec_hash": "h", "model": "m", "profile": "p", "engine": "fake", "gpu_indices": [0],
               "port": 20001, "pid": 7, "state": "ready", "restarts": 0, "url": "http://127.0.0.1:20001"}
    return {"node": "n1", "instance_id": "i", "pools": ["gpu"], "engines": {"fake": {"available": True}},
            "gpus": [{"index": i, "uuid": f"g{i}", "name": "A100", "memory_mib": 81920} for i in range(2)],
            "replicas": [replica, dict(replica, id="r2", gpu_indices=[1], port=20002)]}


def whole(document):
    return schemas._problems(schemas.validator("agent-report"), document, 5)


def test_problems_are_those_of_the_whole_schema():
    good = report()
    assert schemas.problems("agent-report", good) == [] == whole(good)
    breakages = [
        lambda d: d["replicas"][1].update(state="weird"),
        lambda d: d["replicas"][0].pop("spec_hash"),
        lambda d: d["gpus"][1].update(index=-1),
        lambda d: d.update(pools=3, node=""),
        lambda d: d.update(replicas={"r1": {}}),           # not an array: checked whole
        lambda d: d["replicas"].append("not an object"),
    ]
    for breaks in breakages:
        bad = copy.deepcopy(good)
        breaks(bad)
        found = schemas.problems("agent-report", bad)
        assert found and found == whole(bad)
    # One field broken in a replica otherwise valid: named with its path.
    again = copy.deepcopy(good)
    again["replicas"][0]["restarts"] = -1
    assert schemas.problems("agent-report", again) == ["replicas[0].restarts: -1 is less than the minimum of 0"]


# Values a hostile or buggy agent might put anywhere: every JSON type, and the
# edges of the schema's own (empty strings, negatives, floats for integers).
values = st.recursive(st.none() | st.booleans() | st.integers(-3, 70000) | st.floats(allow_nan=False)
                      | st.sampled_from(["", "ready", "weird", "http://127.0.0.1:1"]),
                      lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from(["id", "x"]), inner,
                                                                                  max_size=2), max_leaves=4)


def paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, (*prefix, i))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_compiled_check_accepts_exactly_what_jsonschema_accepts(data):
    """The fast check (fastjsonschema) answers for valid documents alone: it must never pass one
    jsonschema refuses, or a hostile report would skip the schema (issue 19)."""
    assert schemas._fast("agent-report") is not None, "the report schema is one the fast check can take"
    doc = report()
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(list(paths(doc))[1:]))
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            parent.pop(where[-1])
        else:
            parent[where[-1]] = data.draw(values)
    fast = schemas._fast("agent-report")
    try:
        fast(doc)
        passed = True
    except Exception:  # noqa: BLE001 -- any refusal
        passed = False
    valid = schemas.validator("agent-report").is_valid(doc)
    assert not passed or valid, "the fast check passed a report jsonschema refuses"
    assert (schemas.problems("agent-report", doc) == []) == valid


def test_a_schema_with_a_keyword_outside_the_common_subset_gets_no_fast_check(tmp_path, monkeypatch):
    (tmp_path / "odd.schema.json").write_text(
        '{"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "array", "prefixItems": [{"type": "string"}]}')
    (tmp_path / "plain.schema.json").write_text(
        '{"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", '
        '"properties": {"prefixItems": {"type": "string"}}}')
    monkeypatch.setattr(schemas, "SCHEMAS", tmp_path)
    schemas._fast.cache_clear()
    schemas.validator.cache_clear()
    try:
        assert schemas._fast("odd") is None, "prefixItems means another thing in draft 7"
        assert schemas.problems("odd", [3]) != [], "jsonschema still checks it"
        assert schemas._fast("plain") is not None, "a property's name is not a keyword"
    finally:
        schemas._fast.cache_clear()
        schemas.validator.cache_clear()
