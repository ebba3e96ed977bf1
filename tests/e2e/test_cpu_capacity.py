"""`serve --max-cpu-replicas`: 50 CPU models on a node that takes 5 place 5, the rest wait with the reason, serve answers on.

At 48de24a every model with gpus: 0 was placed on the one node, 50 engine
processes for a port range of 10 (the fleet's), churning through port failures.
"""
import requests

from .fleet import Fleet, wait_until

MODELS = 50
LIMIT = 5


def catalog() -> str:
    return "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n" + "".join(
        f"  - {{name: m{i:02d}, profiles: [{{name: cpu, engine: fake, gpus: 0}}]}}\n" for i in range(MODELS))


def test_serve_places_no_more_cpu_replicas_than_its_limit_and_says_why(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(catalog())
    try:
        fleet.start_serve("--settle", "1", "--max-cpu-replicas", str(LIMIT))
        wait_until(lambda: len(fleet.replicas(state="ready")) == LIMIT, f"{LIMIT} replicas ready", timeout=120)
        status = fleet.status()
        models = {m["name"]: m for m in status["models"]}
        placed = sorted({r["model"] for r in status["replicas"]})
        assert len(status["replicas"]) == LIMIT, status["replicas"]
        waiting = [m for name, m in models.items() if name not in placed]
        assert len(waiting) == MODELS - LIMIT
        for m in waiting:
            assert "CPU replicas, its limit" in m["unplaceable"] and f"{LIMIT} CPU replicas" in m["unplaceable"], m
            assert m["unplaceable_permanent"] is False
        # serve keeps answering: a placed model, and an unplaced one at once with the reason.
        reply = fleet.chat(placed[0])
        assert reply.status_code == 200, reply.text
        other = next(m["name"] for m in waiting)
        reply = fleet.chat(other, timeout=30)
        assert reply.status_code == 503 and "its limit" in reply.json()["error"]["message"], reply.text
        assert requests.get(fleet.control + "/healthz", timeout=10).ok
        # And it stays so: no churn of starts past the limit over a few passes.
        passes = fleet.status()["passes"]
        wait_until(lambda: fleet.status()["passes"] >= passes + 3, "three more reconcile passes")
        assert len(fleet.status()["replicas"]) == LIMIT
    finally:
        fleet.close_waiting()
