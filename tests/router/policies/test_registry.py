"""The registry: one `Policy` member per policy, the catalog's names the same, the dispatch a lookup."""
from __future__ import annotations

import json

import pytest

from llmgwctl.catalog import CatalogError, load_text
from llmgwctl.catalog.loader import schema_path
from llmgwctl.catalog.model import ROUTING_POLICIES
from llmgwctl.router.policies import DEFAULT_POLICY, LEAST_LOAD, POLICIES, Policy, Settings
from llmgwctl.router.policies.least_load import LeastLoad
from llmgwctl.router.policies.prefix import BLOCK_CHARS, CostPick, Prefix
from llmgwctl.router.policies.round_robin import RoundRobin, Turns
from llmgwctl.router.policies.session import Session

from .scene import MODEL, Ep, Scene

LONG = {"messages": [{"role": "user", "content": "x" * (4 * BLOCK_CHARS)}], "user": "alice"}


def catalog(routing: str) -> str:
    return f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: m\n    routing: {routing}\n    profiles: [{{engine: fake}}]\n"


def test_the_catalogs_names_and_the_schemas_are_the_enums():
    """The catalog is the layer below and cannot import the Enum: this is what holds the three together."""
    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    assert ROUTING_POLICIES == POLICIES
    assert tuple(schema["$defs"]["model"]["properties"]["routing"]["enum"]) == POLICIES
    assert DEFAULT_POLICY in POLICIES and LEAST_LOAD in POLICIES


@pytest.mark.parametrize("policy", list(Policy), ids=lambda p: p.label)
def test_a_catalog_may_name_every_policy(policy):
    assert load_text(catalog(policy.label)).resolve("m").routing == policy.label


@pytest.mark.parametrize("name", ["prefix-cache", "Prefix", "least_load", "ROUND_ROBIN", ""])
def test_a_name_no_member_has_is_refused_naming_the_field(name):
    with pytest.raises(CatalogError, match=r"models\[0\]\.routing"):
        load_text(catalog(repr(name)))


PLUGINS = [
    pytest.param(Policy.ROUND_ROBIN, RoundRobin, Turns, id="round-robin"),
    pytest.param(Policy.LEAST_LOAD, LeastLoad, type(None), id="least-load"),
    pytest.param(Policy.PREFIX, Prefix, CostPick, id="prefix"),
    pytest.param(Policy.SESSION, Session, CostPick, id="session"),
]


@pytest.mark.parametrize(("policy", "plugin", "chooser"), PLUGINS)
def test_each_member_builds_its_plugin_and_the_name_finds_it(policy, plugin, chooser):
    scene = Scene(Ep("a"), Ep("b"))
    assert isinstance(policy.factory(Settings(scene.balancer, BLOCK_CHARS, 256.0)), plugin)
    assert isinstance(scene.policies.plugin(policy), plugin)
    assert isinstance(scene.policies.chooser(policy.label, MODEL, LONG), chooser)


def test_every_member_is_in_the_table_above():
    assert {p.values[0] for p in PLUGINS} == set(Policy)


@pytest.mark.parametrize("name", [None, "no-such-policy"])
def test_no_policy_or_an_unknown_one_is_least_load(name):
    assert Scene(Ep("a")).policies.chooser(name, MODEL, LONG) is None
