"""A catalog engine no node allows is unplaceable for good, and the reason names the option that allows it."""
from types import MappingProxyType

from llmgwctl.catalog import Catalog, EngineSpec
from llmgwctl.placement import NodeView, place

from .helpers import model, profile

SHELLY = EngineSpec("shelly", command=("sh", "-c", "serve --port {port}"))
CPU = profile("cpu", engine="shelly", pool=None, gpus=0)


def plan_for(nodes):
    return place(Catalog([model("m", CPU)], {"shelly": SHELLY}), nodes, [], {})


def test_a_catalog_engine_no_node_names_is_not_allowed_anywhere():
    plan = plan_for([NodeView("n1", frozenset(), (), frozenset({"fake"}))])
    (unplaceable,) = plan.unplaceable
    assert not plan.start and unplaceable.permanent
    assert unplaceable.reason == (
        "profile cpu (shelly, 0 GPUs, any pool): no node allows catalog engine 'shelly': a node runs a "
        "catalog-defined engine only if its operator allows it (llmgwctl agent --allow-engine shelly=sh)")


def test_a_node_that_allows_it_but_lacks_the_program_gives_its_reason():
    missing = NodeView("n2", frozenset(), (), frozenset({"fake"}),
                       unavailable=MappingProxyType({"shelly": "sh (allowed as engine 'shelly') not found on PATH"}))
    plan = plan_for([NodeView("n1", frozenset(), (), frozenset({"fake"})), missing])
    (unplaceable,) = plan.unplaceable
    assert unplaceable.reason.endswith(
        "no node can run engine shelly (n1 lacks it: not allowed there (llmgwctl agent --allow-engine shelly=sh); "
        "n2 lacks it: sh (allowed as engine 'shelly') not found on PATH)")


def test_a_node_that_allows_it_is_placed_on():
    plan = plan_for([NodeView("n1", frozenset(), (), frozenset({"fake"})),
                     NodeView("n2", frozenset(), (), frozenset({"fake", "shelly"}))])
    assert [a.node for a in plan.start] == ["n2"] and not plan.unplaceable
