"""Issue 15 end to end: a controller, two agents on simulated L4s, fake engines.

In order, on one fleet: memory profiles share a GPU and a model that can
never fit says so; a model with no whole GPU left runs on its fallback and
status marks it; a higher-priority model's minimum preempts a lower one
(traffic first, then the process) and both sides say who holds what; when
room frees up, the fallback is moved back to its best profile by surge.
"""
import json
import subprocess
import sys

import pytest

from .fleet import Fleet, wait_until

HEAD = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"
DEV = """\
  - name: dev
    profiles: [{name: gpu, engine: fake, pool: gpu, gpus: 2}]
"""
SMALL = """\
  - name: small
    replicas: 2
    profiles: [{name: shared, engine: fake, pool: gpu, gpus: 1, gpu_memory: 10GiB}]
"""
CHAT = """\
  - name: chat
    profiles:
      - {name: gpu, engine: fake, pool: gpu, gpus: 1, priority: 10}
      - {name: cpu, engine: fake, gpus: 0, priority: 1}
"""
HUGE = """\
  - name: huge
    profiles: [{name: gpu, engine: fake, pool: gpu, gpus: 4}]
"""
PROD = """\
  - name: prod
    priority: 10
    profiles: [{name: gpu, engine: fake, pool: gpu, gpus: 2}]
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("placement"))
    (fleet.catalogs / "models.yaml").write_text(HEAD + DEV + SMALL + CHAT + HUGE)
    try:
        fleet.start_controller()
        fleet.start_agent("n1", "2xL4-24GB", "gpu")
        fleet.start_agent("n2", "1xL4-24GB", "gpu")
        yield fleet
    finally:
        fleet.close_checked()


def models(fleet):
    return {m["name"]: m for m in fleet.status()["models"]}


def write(fleet, *parts):
    (fleet.catalogs / "models.yaml").write_text(HEAD + "".join(parts))


def test_memory_profiles_share_one_gpu_and_a_model_too_big_says_it_never_fits(fleet):
    wait_until(lambda: len(fleet.ready("small")) == 2 and fleet.ready("dev"), "dev and both small replicas ready")
    (dev,) = fleet.ready("dev")
    assert dev["node"] == "n1" and len(dev["gpus"]) == 2
    smalls = fleet.ready("small")
    # n1's GPUs are dev's whole; both 10 GiB replicas fit in n2's one 24 GiB GPU.
    assert {(r["node"], tuple(r["gpus"])) for r in smalls} == {("n2", (0,))}
    assert fleet.chat("small").status_code == 200
    huge = models(fleet)["huge"]
    assert huge["unplaceable_permanent"] is True
    assert "the largest node in pool gpu that runs fake has 2 GPUs; this profile needs 4, so it can never be placed" \
        in huge["unplaceable"]


def test_a_model_without_a_whole_gpu_runs_on_its_fallback_and_status_marks_it(fleet):
    wait_until(lambda: fleet.ready("chat"), "chat ready")
    (chat,) = fleet.ready("chat")
    assert chat["profile"] == "cpu" and chat["fallback"] is True
    assert not any(r["fallback"] for r in fleet.replicas() if r["model"] != "chat")
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", fleet.control],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(chat["id"]))
    assert "cpu*" in row.split()
    assert "a fallback profile" in out.stdout and "cannot place huge (never, with this fleet)" in out.stdout


def test_a_higher_priority_minimum_preempts_a_lower_model_and_both_say_who(fleet):
    (dev,) = fleet.ready("dev")
    write(fleet, DEV, SMALL, CHAT, HUGE, PROD)
    wait_until(lambda: fleet.ready("prod"), "prod ready on the preempted GPUs")
    (prod,) = fleet.ready("prod")
    assert prod["node"] == "n1" and sorted(prod["gpus"]) == sorted(dev["gpus"])
    assert dev["id"] not in {r["id"] for r in fleet.replicas()}, "the victim is gone"
    events = fleet.status()["events"]
    preempted = [e for e in events if e["kind"] == "replica-preempted"]
    assert preempted and dev["id"] in preempted[0]["message"] and "preempted by prod (priority 10)" in \
        preempted[0]["message"]
    # The victim was out of the router before its engine was told to stop.
    kinds = [e["kind"] for e in events if dev["id"] in e["message"]]
    assert kinds.index("replica-preempted") < kinds.index("replica-stopping")
    why = models(fleet)["dev"]
    assert why["unplaceable_permanent"] is False and "GPUs held by prod (priority 10, 2 GPUs)" in why["unplaceable"]
    # No flapping: a few passes later the victim has not come back.
    passes = fleet.status()["passes"]
    wait_until(lambda: fleet.status()["passes"] >= passes + 3, "three more reconcile passes")
    assert not fleet.replicas("dev") and fleet.ready("prod")


def test_when_room_frees_the_fallback_moves_back_to_its_best_profile_by_surge(fleet):
    (old,) = fleet.ready("chat")
    write(fleet, DEV, CHAT, HUGE, PROD)           # small leaves: n2's GPU is whole again
    wait_until(lambda: [r["profile"] for r in fleet.replicas("chat")] == ["gpu"]
               and fleet.ready("chat"), "chat moved to its gpu profile")
    (new,) = fleet.ready("chat")
    assert new["node"] == "n2" and new["fallback"] is False
    events = fleet.status()["events"]
    moving = next(e for e in events if e["kind"] == "replica-moving")
    assert new["id"] in moving["message"] and old["id"] in moving["message"]
    # Surge: the new replica was ready before the fallback started draining.
    order = [(e["kind"], e["message"]) for e in events]
    ready_at = next(i for i, (k, m) in enumerate(order) if k == "replica-ready" and new["id"] in m)
    drain_at = next(i for i, (k, m) in enumerate(order) if k == "replica-draining" and old["id"] in m)
    assert ready_at < drain_at and "moved back to profile gpu" in order[drain_at][1]
    assert fleet.chat("chat").status_code == 200
    json.dumps(fleet.status())      # the whole status stays serialisable
