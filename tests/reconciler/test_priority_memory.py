"""Issue 15 through the reconciler: preemption drains through the usual path and says who preempted whom,
memory shares reach the spec, a fallback is moved back by surge (rate-limited), permanence is kept."""
from llmgwctl.catalog import load_text

from .test_reconciler import HEADER, World, converge


def cat(text):
    return load_text(HEADER + text)


PRIORITIES = """\
  - name: dev
    priority: 0
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 2}]
  - name: prod
    priority: 10
    replicas: 0
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 2}]
"""


class MemoryWorld(World):
    """Agents whose GPUs report memory (24 GiB each, all free)."""

    def report(self, node, gpus=2, pools=("gpu",)):
        self.alive.add(node)
        self.inventory.report(node, {
            "node": node, "pools": list(pools), "engines": {"fake": {"available": True, "reason": ""},
                                                            "llamacpp": {"available": True, "reason": ""}},
            "gpus": [{"index": i, "uuid": f"{node}-{i}", "name": "L4", "memory_mib": 24576,
                      "memory_free_mib": 24576} for i in range(gpus)],
            "replicas": list(self.running.get(node, {}).values()),
        })


def test_preemption_drains_the_victim_first_and_says_who_preempted_whom():
    w = World(cat(PRIORITIES), settle=0)
    w.report("n1")
    converge(w)
    (dev,) = w.rec.replicas.values()
    assert dev.state == "ready"
    w.usage.snapshot = {dev.spec.id: (w.clock.now, 1)}      # a request in flight on it
    w.live.swap(cat(PRIORITIES.replace("replicas: 0", "replicas: 1")))
    w.step()
    assert dev.state == "draining" and "preempted by prod (priority 10)" in dev.drain_reason
    assert dev.spec.id not in {e.replica_id for e in w.rec.endpoints}, "traffic leaves first"
    assert any(e.kind == "replica-preempted" and dev.spec.id in e.message and "prod" in e.message
               for e in w.rec.events)
    assert w.rec.unplaceable["prod"].startswith(f"preempting dev (priority 0, {dev.spec.id}) on n1")
    status = w.rec.status()
    assert {m["name"]: m["priority"] for m in status["models"]} == {"dev": 0, "prod": 10}
    w.usage.snapshot = {}
    for _ in range(4):
        w.step()
        w.agent_follows("n1")
    w.step()
    assert sorted((r.spec.model, r.state) for r in w.rec.replicas.values()) == [("prod", "ready")]
    assert "GPUs held by prod (priority 10, 2 GPUs)" in w.rec.unplaceable["dev"]
    assert not w.rec.unplaceable_detail["dev"].permanent


def test_memory_profiles_share_a_gpu_and_the_spec_carries_the_share():
    w = MemoryWorld(cat("""\
  - name: small
    replicas: 2
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 1, gpu_memory: 10GiB}]
"""), settle=0)
    w.report("n1", gpus=1)
    converge(w)
    recs = list(w.rec.replicas.values())
    assert [r.state for r in recs] == ["ready", "ready"]
    assert {r.spec.gpu_indices for r in recs} == {(0,)}
    assert {r.spec.gpu_memory_share for r in recs} == {10240 / 24576}
    assert any("42% of their memory" in e.message for e in w.rec.events if e.kind == "replica-placed")


def test_permanent_reason_is_kept_on_the_record():
    w = MemoryWorld(cat("""\
  - name: big
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 1, gpu_memory: 40GiB}]
"""), settle=0)
    w.report("n1")
    w.step()
    assert w.rec.unplaceable_detail["big"].permanent
    status = w.rec.status()
    assert status["models"][0]["unplaceable_permanent"] is True
    assert "can never be placed" in status["models"][0]["unplaceable"]


FALLBACK = """\
  - name: a
    profiles:
      - {name: gpu, engine: fake, pool: gpu, gpus: 2, priority: 10}
      - {name: cpu, engine: llamacpp, gpus: 0, priority: 1}
  - name: hog
    priority: 5
    replicas: HOG
    profiles: [{name: p, engine: fake, pool: gpu, gpus: 2}]
"""


def test_fallback_is_marked_and_moved_back_by_surge_then_rate_limited():
    w = MemoryWorld(cat(FALLBACK.replace("HOG", "1")), settle=0)
    w.rec.move_every = 300
    w.report("n1")
    converge(w)
    by_model = {r.spec.model: r for r in w.rec.replicas.values()}
    assert by_model["a"].spec.profile == "cpu"
    fallback = {r["id"]: r["fallback"] for r in w.rec.status()["replicas"]}
    assert fallback == {by_model["a"].spec.id: True, by_model["hog"].spec.id: False}

    # The hog goes away. A move of `a` a moment ago holds the next one back for move_every.
    w.rec.planner.moved["a"] = w.clock.now
    w.live.swap(cat(FALLBACK.replace("HOG", "0")))
    for _ in range(3):
        w.step(10)
        w.agent_follows("n1")
    assert [r.spec.profile for r in w.rec.replicas.values()] == ["cpu"]
    # Past it: a surge on the GPU profile, the fallback serving until that one is ready.
    w.step(300)
    w.agent_follows("n1", state="starting")
    w.step()
    states = sorted((r.spec.profile, r.state) for r in w.rec.replicas.values() if r.spec.model == "a")
    assert ("cpu", "ready") in states and ("gpu", "starting") in states
    assert any(e.kind == "replica-moving" for e in w.rec.events)
    for report in w.running["n1"].values():
        report["state"] = "ready"            # its health check passed
    w.step()
    old = by_model["a"]
    assert old.state in ("draining", "stopping") and old.drain_reason.startswith("moved back to profile gpu")
    for _ in range(3):
        w.agent_follows("n1")
        w.step()
    assert sorted((r.spec.profile, r.state) for r in w.rec.replicas.values()) == [("gpu", "ready")]
    assert not any(r["fallback"] for r in w.rec.status()["replicas"])


def test_a_lost_nodes_replacement_goes_only_where_there_is_room_never_by_preemption():
    # prod's only replica is on a node that stops reporting: it is given up at
    # the node timeout and a replacement placed -- but the only other node is
    # dev's, and a model with replicas on a lost node never preempts (the node
    # may come back with them; failfast's rule: replaced only where there is room).
    w = World(cat(PRIORITIES.replace("replicas: 0", "replicas: 1")), settle=0)
    w.report("n1")
    w.report("n2")
    converge(w, nodes=("n1", "n2"))
    by_model = {r.spec.model: r for r in w.rec.replicas.values()}
    assert {m: r.state for m, r in by_model.items()} == {"dev": "ready", "prod": "ready"}
    lost, other = by_model["prod"].node, by_model["dev"].node
    w.alive.discard(lost)
    for _ in range(3):
        w.clock.now += 8                    # past the node timeout (15 s), inside the grace (60 s)
        w.agent_follows(other)
        w.rec.reconcile_once()
    assert any(e.kind == "replica-replaced" and by_model["prod"].spec.id in e.message for e in w.rec.events)
    assert [(r.spec.model, r.state) for r in w.rec.replicas.values()] == [("dev", "ready")]
    assert not any(e.kind == "replica-preempted" for e in w.rec.events)
    assert "preempting" not in w.rec.unplaceable["prod"]
    assert not w.rec.unplaceable_detail["prod"].permanent    # the node may come back, dev may end
