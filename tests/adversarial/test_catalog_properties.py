"""The catalog loader raises nothing but CatalogError, whatever bytes or YAML a file holds.

At b616774 `.nan` raised ValueError from format_duration, `!!float x` a
ValueError from PyYAML, and deep nesting crashed the process: anything but
CatalogError ends the watcher's reload or answers 500 to `catalog apply`.
"""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgwctl.catalog import Catalog, CatalogError, load_text

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\n"
BOUNDED = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def loads_or_rejects(data) -> None:
    try:
        catalog = load_text(data)
    except CatalogError as exc:
        assert exc.problems and all(len(p.message) <= 303 for p in exc.problems)
    else:
        assert isinstance(catalog, Catalog)
        json.dumps(catalog.to_dict())  # what the control API serves must serialise


@BOUNDED
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(data):
    loads_or_rejects(data)


@BOUNDED
@given(st.binary(max_size=512))
def test_arbitrary_bytes_after_a_valid_header(data):
    loads_or_rejects(HEADER.encode() + data)


# YAML-ish values: every scalar YAML can spell, tags included, nested.
SCALARS = st.sampled_from([
    "0", "-1", "1", "1000", "1001", "99999999999999999999", ".nan", ".inf", "-.inf", "1.0e+999", "1e3", "0x1f",
    "true", "no", "null", "~", "''", "15m", "1h30m", "-5s", "x", "fake", "vllm", "!!float x", "!!int x",
    "!!binary x", "!!timestamp 2024-01-01", "2024-01-01", "'{source}'", "&a 1", "*a", "[]", "{}",
])
KEYS = st.sampled_from(["name", "aliases", "source", "replicas", "min", "max", "idle_timeout", "profiles",
                        "engine", "pool", "gpus", "priority", "weight", "args", "env", "command", "health",
                        "metrics", "models", "engines", "1", "true", "FOO", "<<"])


class Mapping(tuple):
    """(key, value) pairs rendered as a YAML flow mapping (a list renders as a sequence)."""


def _render(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_render(v)}" for k, v in value) + "}"
    return "[" + ", ".join(_render(v) for v in value) + "]"


VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.lists(st.tuples(KEYS, inner), max_size=5).map(Mapping), max_leaves=25)


@BOUNDED
@given(st.lists(st.tuples(KEYS, VALUES), max_size=6))
def test_arbitrary_yaml_models(fields):
    model = "{" + ", ".join(f"{k}: {_render(v)}" for k, v in fields) + "}"
    loads_or_rejects(HEADER + f"models: [{model}, {{name: ok, profiles: [{{engine: fake}}]}}]\n")


@BOUNDED
@given(st.lists(st.tuples(KEYS, VALUES), max_size=6))
def test_arbitrary_yaml_documents(fields):
    loads_or_rejects(HEADER + "".join(f"{k}: {_render(v)}\n" for k, v in fields))
