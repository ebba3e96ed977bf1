"""The GPU view (control.gpuview): per node, each GPU's memory and who holds how much of it; paged."""
from __future__ import annotations

from llmgwctl.control.gpuview import gpu_view

from ..reconciler.test_priority_memory import MemoryWorld, cat
from ..reconciler.test_reconciler import converge


def test_shares_and_whole_gpus_per_node_with_what_is_held_outside_and_pages():
    w = MemoryWorld(cat("""\
  - name: small
    replicas: 2
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 1, gpu_memory: 10GiB}]
  - name: whole
    replicas: 1
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 1}]
"""), settle=0)
    w.report("n1", gpus=2)
    w.report("n2", gpus=1)
    converge(w, nodes=("n1", "n2"))
    view = gpu_view(w.inventory.nodes(), w.rec.replicas)
    assert view["total"] == 2 and [n["name"] for n in view["nodes"]] == ["n1", "n2"]
    gpus = [g for n in view["nodes"] for g in n["gpus"]]
    shares = [r for g in gpus for r in g["replicas"] if not r["whole"]]
    assert sorted((r["model"], r["memory_mib"]) for r in shares) == [("small", 10240), ("small", 10240)]
    (whole,) = [g for g in gpus if any(r["whole"] for r in g["replicas"])]
    assert whole["replicas"][0]["model"] == "whole" and whole["replicas"][0]["memory_mib"] == 24576
    assert all(g["memory_mib"] == 24576 and g["free_mib"] == 24576 for g in gpus)
    # All free as the agent read it: nothing held outside llmgw (never below zero for the shares).
    assert {g["other_mib"] for g in gpus} == {0}
    page = gpu_view(w.inventory.nodes(), w.rec.replicas, offset=1, limit=1)
    assert page["total"] == 2 and [n["name"] for n in page["nodes"]] == ["n2"]
    assert gpu_view(w.inventory.nodes(), w.rec.replicas, prefix="n2")["total"] == 1


class _ByNodeOnly:
    """The reconciler's records, answering only what a page of nodes needs: a walk of every record fails."""

    def __init__(self, records):
        self.records = records
        self.asked: list[str] = []

    def of(self, node):
        self.asked.append(node)
        return self.records.of(node)


def test_a_page_reads_only_its_own_nodes_records():
    # Each open console asks for a page every few seconds: at 20,000 replicas a walk of all of them
    # per answer is what the page must not cost (bench/console.py).
    w = MemoryWorld(cat("""\
  - name: whole
    replicas: 3
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 1}]
"""), settle=0)
    for n in ("n1", "n2", "n3"):
        w.report(n, gpus=1)
    converge(w, nodes=("n1", "n2", "n3"))
    records = _ByNodeOnly(w.rec.replicas)
    page = gpu_view(w.inventory.nodes(), records, offset=1, limit=1)
    assert [n["name"] for n in page["nodes"]] == ["n2"] and records.asked == ["n2"]
    assert [r["model"] for r in page["nodes"][0]["gpus"][0]["replicas"]] == ["whole"]
