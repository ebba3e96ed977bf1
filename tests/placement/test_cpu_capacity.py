"""A node's CPU replicas (profiles with gpus: 0) are bounded by what its agent reports, with a reason when full."""
from __future__ import annotations

import dataclasses

import pytest

from llmgwctl.agent.capacity import CPU_REPLICAS_PER_CORE, cpu_capacity
from llmgwctl.agent.ports import PortRange
from llmgwctl.contracts import AgentReport, CpuCapacity, ReportError
from llmgwctl.placement import place

from .helpers import apply, catalog, model, node, profile, replica


def cpu_node(name: str, limit: int | None, gpus: int = 0) -> object:
    return dataclasses.replace(node(name, gpus=gpus, pools=("cpu",), engines=("fake", "llamacpp")), cpu_replicas=limit)


def cpu_model(name: str, replicas: int = 1):
    return model(name, profile("cpu", engine="fake", pool=None, gpus=0), lo=replicas, hi=replicas)


@pytest.mark.parametrize("limit, models, replicas_each, placed", [
    (8, 1000, 1, 8),        # the issue: 1,000 one-replica CPU models on one node
    (5, 50, 1, 5),
    (3, 1, 10, 3),          # one model wanting more than the node takes
    (0, 4, 1, 0),           # an operator's --max-cpu-replicas 0: a GPU-only node
    (100, 20, 2, 40),       # room for all
    (None, 50, 1, 50),      # an agent that reports no limit: only the per-node cap
])
def test_a_node_gets_at_most_its_cpu_limit(limit, models, replicas_each, placed):
    cat = catalog(*(cpu_model(f"m{i:04d}", replicas_each) for i in range(models)))
    plan = place(cat, [cpu_node("vm", limit)], [], {})
    assert len(plan.start) == placed
    assert len(plan.unplaceable) == models * replicas_each - placed
    for u in plan.unplaceable:
        assert "node vm" in u.reason and f"{limit} CPU replica" in u.reason and "its limit" in u.reason, u.reason
        assert not u.permanent              # a CPU replica stopping, or the limit raised, makes room


@pytest.mark.parametrize("limits, placed", [
    ((2, 3), 5),
    ((4, None), 30),
    ((0, 0), 0),
])
def test_each_node_is_bounded_by_its_own_limit(limits, placed):
    nodes = [cpu_node(f"n{i}", limit) for i, limit in enumerate(limits)]
    plan = place(catalog(*(cpu_model(f"m{i}") for i in range(30))), nodes, [], {})
    assert len(plan.start) == placed
    per_node = {n.name: sum(1 for a in plan.start if a.node == n.name) for n in nodes}
    for n, limit in zip(nodes, limits):
        assert limit is None or per_node[n.name] <= limit


def test_running_cpu_replicas_count_and_gpu_replicas_do_not():
    # 2 CPU replicas already run there, and one on a GPU: the limit of 3 leaves room for one more.
    cat = catalog(*(cpu_model(f"m{i}") for i in range(6)),
                  model("big", profile("gpu", engine="fake", pool="cpu", gpus=1), lo=1, hi=1))
    running = [replica("r1", "m0", "vm", gpus=(), profile="cpu"), replica("r2", "m1", "vm", gpus=(), profile="cpu"),
               replica("r3", "big", "vm", gpus=(0,), profile="gpu")]
    plan = place(cat, [cpu_node("vm", 3, gpus=2)], running, {})
    assert [a.model for a in plan.start] == ["m2"]
    # The next pass, with those applied, places nothing more and starts nothing twice.
    again = place(cat, [cpu_node("vm", 3, gpus=2)], apply(plan, running), {})
    assert again.start == () and len(again.unplaceable) == 3


def test_a_full_node_still_takes_gpu_replicas():
    cat = catalog(*(cpu_model(f"m{i}") for i in range(4)),
                  model("gpu-model", profile("gpu", engine="fake", pool="cpu", gpus=1), lo=2, hi=2))
    plan = place(cat, [cpu_node("vm", 1, gpus=2)], [], {})
    assert sorted(a.model for a in plan.start) == ["gpu-model", "gpu-model", "m0"]


def test_cpu_replicas_spill_to_the_next_node_when_one_is_full():
    plan = place(catalog(*(cpu_model(f"m{i}") for i in range(6))), [cpu_node("a", 2), cpu_node("b", 4)], [], {})
    assert sorted(a.node for a in plan.start) == ["a", "a", "b", "b", "b", "b"]
    assert plan.unplaceable == ()


@pytest.mark.parametrize("cores, mib, ports, asked, expected", [
    (2, 24_000, 1000, None, 2 * CPU_REPLICAS_PER_CORE),     # this dev machine: the README's 2 CPU models fit
    (64, 512_000, 1000, None, 64 * CPU_REPLICAS_PER_CORE),
    (8, 1024, 1000, None, 4),                               # little memory for its cores
    (2, 24_000, 10, None, 8),
    (2, 24_000, 5, None, 5),                                # the port range is the ceiling
    (2, 24_000, 1000, 50, 50),                              # the operator's word, past the default
    (2, 24_000, 20, 50, 20),                                # ...but not past the ports
    (2, 24_000, 1000, 0, 0),
])
def test_the_agents_default_and_the_operators_limit(cores, mib, ports, asked, expected):
    cap = cpu_capacity(PortRange(20000, 20000 + ports - 1), asked, n_cores=cores, mib=mib)
    assert cap == CpuCapacity(cores=cores, memory_mib=mib, max_replicas=expected)


def test_the_report_carries_it_and_refuses_what_is_out_of_bounds():
    cap = CpuCapacity(cores=2, memory_mib=24_000, max_replicas=8)
    report = AgentReport(node="vm", cpu=cap)
    assert AgentReport.from_dict(report.to_dict()).cpu == cap
    assert "cpu" not in AgentReport(node="vm").to_dict()         # an agent that does not say: as before
    assert AgentReport.from_dict(AgentReport(node="vm").to_dict()).cpu is None
    for bad in ({"max_replicas": 1001}, {"max_replicas": -1}, {"max_replicas": True}, {"cores": 1 << 20, "max_replicas": 1}):
        with pytest.raises(ReportError, match="cpu"):
            AgentReport.from_dict(dict(report.to_dict(), cpu=bad))
