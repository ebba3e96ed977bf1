"""The controller end to end: real `llmgwctl serve`, two agents in different pools, fake engines.

The tests run in order against one fleet, each leaving it in the state the
next expects, as an operator's day would: converge, add, remove, apply,
restart the controller, idle down and wake, lose a node.
"""
import json
import signal
import subprocess
import sys
import threading

import pytest
import requests
import yaml

from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: big
    profiles: [{name: a100, engine: fake, pool: a100, gpus: 2}]
  - name: small
    aliases: [chat]
    profiles: [{name: l4, engine: fake, pool: l4, gpus: 1, args: [--tokens-per-second, "40"]}]
  - name: anywhere
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_controller()
        fleet.start_agent("n1", "2xA100-80GB", "a100")
        fleet.start_agent("n2", "2xL4-24GB", "l4")
        yield fleet
    finally:
        fleet.close_checked()


def pids(fleet):
    return {r["id"]: r["pid"] for r in fleet.replicas()}


def test_catalog_converges_on_the_right_pools(fleet):
    for model in ("big", "small", "anywhere"):
        wait_until(lambda model=model: fleet.ready(model), f"{model} ready")
    (big,), (small,) = fleet.ready("big"), fleet.ready("small")
    assert big["node"] == "n1" and len(big["gpus"]) == 2
    assert small["node"] == "n2" and len(small["gpus"]) == 1
    reply = fleet.chat("chat")  # an alias, through the router
    assert reply.status_code == 200, reply.text
    assert f"replica={small['id']}" in reply.json()["choices"][0]["message"]["content"]
    assert reply.headers["x-llmgw-replica"] == small["id"]
    nodes = {n["name"]: n for n in fleet.status()["nodes"]}
    assert nodes["n1"]["pools"] == ["a100"] and nodes["n1"]["gpus_used"] == 2 and nodes["n1"]["state"] == "ready"


def test_status_command_tables_and_json(fleet):
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", fleet.control],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, "status must fit a 100-column terminal"
    assert any(line.split()[:4] == ["MODEL", "ALIASES", "DESIRED", "READY"] for line in lines)
    assert any(line.split()[:1] == ["REPLICA"] for line in lines) and any(line.startswith("NODE") for line in lines)
    assert sum(" ready " in line for line in lines) >= 3 + 2   # 3 replicas, 2 nodes
    as_json = json.loads(subprocess.run([sys.executable, "-m", "llmgwctl", "status", "-o", "json", "--controller",
                                         fleet.control], capture_output=True, text=True, timeout=60).stdout)
    assert sorted(m["name"] for m in as_json["models"]) == ["anywhere", "big", "small"]
    assert {r["state"] for r in as_json["replicas"]} == {"ready"}
    assert as_json["events"][0]["kind"] == "catalog-loaded"
    one = json.loads(subprocess.run([sys.executable, "-m", "llmgwctl", "status", "-o", "json", "--model", "small",
                                     "--controller", fleet.control], capture_output=True, text=True, timeout=60).stdout)
    assert [m["name"] for m in one["models"]] == ["small"] and {r["model"] for r in one["replicas"]} == {"small"}
    unknown = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--model", "nope", "--controller",
                              fleet.control], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 1 and "404" in unknown.stderr and "no model 'nope'" in unknown.stderr
    gone = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "cannot reach the controller at http://127.0.0.1:9" in gone.stderr


def test_invalid_edit_is_rejected_and_the_catalog_stays(fleet):
    version = fleet.status()["catalog"]["version"]
    broken = fleet.catalogs / "broken.yaml"
    broken.write_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: small\n    profiles: [{engine: fake}]\n")
    try:
        wait_until(lambda: not fleet.status()["catalog"]["directory_valid"], "the rejection")
        status = fleet.status()
        assert status["catalog"]["version"] == version
        assert "name 'small' is already the name of model 'small'" in status["catalog"]["last_rejection"]["errors"][0]
        assert status["events"][-1]["kind"] == "catalog-rejected"
        assert fleet.chat("small", max_tokens=2).status_code == 200
        table = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", fleet.control],
                               capture_output=True, text=True, timeout=60).stdout
        assert "last edit REJECTED" in table
    finally:
        broken.unlink()
    wait_until(lambda: fleet.status()["catalog"]["directory_valid"], "the directory valid again")


def test_payloads_follow_their_schemas(fleet):
    from llmgwctl.control import schemas

    desired = requests.get(fleet.control + "/api/v1/agents/n1/desired", params={"after": -1}, timeout=10).json()
    assert schemas.problems("desired", desired) == [] and desired["replicas"]
    watch = requests.get(fleet.control + "/api/v1/watch/endpoints", params={"after": -1}, timeout=10).json()
    assert schemas.problems("watch-endpoints", watch) == [] and len(watch["endpoints"]) == 3
    # Agents' reports are checked on arrival; a malformed one changes nothing and says why.
    before = fleet.status()["nodes"]
    bad = requests.post(fleet.control + "/api/v1/agents/n1/report", timeout=10,
                        json={"node": "n1", "gpus": [{"index": "zero"}], "replicas": []})
    assert bad.status_code == 400
    assert "gpus[0].index: 'zero' is not of type 'integer'" in bad.json()["error"]["message"]
    assert [n["gpus"] for n in fleet.status()["nodes"]] == [n["gpus"] for n in before]


def test_adding_a_model_by_file_leaves_the_others_alone(fleet):
    before = pids(fleet)
    (fleet.catalogs / "extra.yaml").write_text(
        "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: extra\n    profiles: [{engine: fake, gpus: 0, pool: l4,"
        " args: [--tokens-per-second, '30']}]\n")
    wait_until(lambda: fleet.ready("extra"), "extra ready")
    assert fleet.ready("extra")[0]["node"] == "n2"
    after = pids(fleet)
    assert {k: after[k] for k in before} == before
    assert fleet.chat("extra").status_code == 200


def test_removing_a_model_drains_it_without_failing_streams_to_others(fleet):
    failures, done = [], []

    def stream_to_small():
        # ~2.5 s of streaming at 40 tokens/s while the other model goes away.
        with requests.post(fleet.router + "/v1/chat/completions", stream=True, timeout=60,
                           json={"model": "small", "stream": True, "max_tokens": 100, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": "long"}]}) as resp:
            if resp.status_code != 200:
                failures.append(resp.status_code)
                return
            body = b"".join(resp.iter_content(None))
            if not body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body:
                failures.append(body[-200:])
        done.append(1)

    extra_stream = {}

    def stream_to_extra():
        # A request already running on the model being removed finishes (~4 s, longer than the
        # agent's 3 s stop grace): the engine must not be told to stop before it is drained.
        with requests.post(fleet.router + "/v1/chat/completions", stream=True, timeout=60,
                           json={"model": "extra", "stream": True, "max_tokens": 120, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": "long"}]}) as resp:
            extra_stream["status"] = resp.status_code
            extra_stream["body"] = b"".join(resp.iter_content(None))

    threads = [threading.Thread(target=stream_to_small) for _ in range(4)] + [threading.Thread(target=stream_to_extra)]
    for t in threads:
        t.start()
    extra = fleet.ready("extra")[0]
    wait_until(lambda: any(r["id"] == extra["id"] and r["inflight"] for r in fleet.replicas("extra")), "the stream to extra")
    (fleet.catalogs / "extra.yaml").unlink()
    for _ in range(20):
        r = fleet.chat("small", max_tokens=2)
        if r.status_code != 200:
            failures.append(r.status_code)
    wait_until(lambda: not fleet.replicas("extra"), "extra's replica gone")
    for t in threads:
        t.join(60)
    assert failures == [] and len(done) == 4
    assert extra_stream["status"] == 200 and extra_stream["body"].rstrip().endswith(b"data: [DONE]"), extra_stream
    assert b'"error"' not in extra_stream["body"]
    events = [e["kind"] + ": " + e["message"] for e in fleet.status()["events"]]
    assert any(e.startswith("replica-draining: " + extra["id"]) for e in events)
    assert any(e.startswith("replica-stopped: " + extra["id"]) for e in events)
    assert fleet.chat("extra").status_code == 404


def apply(fleet, path, *args):
    return subprocess.run([sys.executable, "-m", "llmgwctl", "catalog", "apply", "-f", str(path), "--controller",
                           fleet.control, *args], capture_output=True, text=True, timeout=60)


def test_catalog_apply_dry_run_plans_and_invalid_is_rejected(fleet, tmp_path):
    changed = tmp_path / "models.yaml"
    changed.write_text(CATALOG.replace("name: anywhere", "name: anywhere\n    aliases: [any]")
                       .replace("  - name: big\n    profiles: [{name: a100, engine: fake, pool: a100, gpus: 2}]\n", "")
                       + "  - name: fresh\n    profiles: [{engine: fake, gpus: 0, pool: a100}]\n")
    before = (fleet.catalogs / "models.yaml").read_text()
    plan = apply(fleet, changed, "--dry-run", "-o", "json")
    assert plan.returncode == 0, plan.stderr
    body = json.loads(plan.stdout)
    assert body["diff"]["added"] == ["fresh"] and body["diff"]["removed"] == ["big"]
    assert body["diff"]["changed"] == {"anywhere": [{"path": "aliases", "old": None, "new": ["any"]}]}
    assert [(s["model"], s["node"]) for s in body["replicas"]["start"]] == [("fresh", "n1")]
    assert [s["model"] for s in body["replicas"]["stop"]] == ["big"]
    assert (fleet.catalogs / "models.yaml").read_text() == before, "a dry run wrote the file"
    table = apply(fleet, changed, "--dry-run")
    assert "+ model fresh" in table.stdout and "- model big" in table.stdout and "dry run: nothing written" in table.stdout

    profile_change = tmp_path / "models.yaml"
    profile_change.write_text(CATALOG.replace("gpus: 0}]", "gpus: 0, args: [--ttft, '0.01']}]"))
    body = json.loads(apply(fleet, profile_change, "--dry-run", "-o", "json").stdout)
    assert [r["model"] for r in body["replicas"]["replace"]] == ["anywhere"]

    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: chat\n    profiles: [{engine: vlm}]\n")
    rejected = apply(fleet, bad)
    assert rejected.returncode == 1
    # Files are read in name order, so bad.yaml's model came first and the alias in models.yaml is the repeat.
    assert (f"{fleet.catalogs}/models.yaml:7:15: models[1].aliases[0]: alias 'chat' is already the name of model 'chat' "
            f"({fleet.catalogs}/bad.yaml: models[0].name)") in rejected.stderr
    assert "models[0].profiles[0].engine: 'vlm' is not one of fake, llamacpp, sglang, vllm" in rejected.stderr
    assert not (fleet.catalogs / "bad.yaml").exists()

    alias_only = tmp_path / "models.yaml"
    alias_only.write_text(CATALOG.replace("aliases: [chat]", "aliases: [chat, talk]"))
    applied = apply(fleet, alias_only)
    assert applied.returncode == 0 and "in force" in applied.stdout, applied.stdout + applied.stderr
    assert fleet.chat("talk").status_code == 200


def test_catalog_apply_reads_standard_input_named_by_as(fleet):
    # `-f -` as kubectl takes it: a generated catalog piped in, named by --as.
    # The directory's models.yaml has aliases [chat, talk] from the test above.
    piped = CATALOG.replace("aliases: [chat]", "aliases: [chat, talk, speak]")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "llmgwctl", "catalog", "apply", "-f", "-",
                               "--controller", fleet.control, *args],
                              input=piped, capture_output=True, text=True, timeout=60)

    unnamed = run("--dry-run")
    assert unnamed.returncode == 2 and "--as NAME.yaml" in unnamed.stderr
    plan = run("--as", "models.yaml", "--dry-run", "-o", "yaml")
    assert plan.returncode == 0, plan.stderr
    assert yaml.safe_load(plan.stdout)["diff"]["changed"]["small"] == [
        {"path": "aliases", "old": ["chat", "talk"], "new": ["chat", "talk", "speak"]}]
    applied = run("--as", "models.yaml")
    assert applied.returncode == 0 and "in force" in applied.stdout, applied.stdout + applied.stderr
    assert fleet.chat("speak").status_code == 200


def test_controller_restart_adopts_every_replica_without_restarting_engines(fleet):
    before = {r["id"]: (r["pid"], r["node"]) for r in fleet.replicas()}
    assert len(before) == 3
    fleet.kill_controller(signal.SIGKILL)
    fleet.start_controller()
    wait_until(lambda: fleet.status()["settled"] and len(fleet.replicas(state="ready")) == 3, "adoption")
    after = {r["id"]: (r["pid"], r["node"]) for r in fleet.replicas()}
    assert after == before
    assert all(r["adopted"] and r["restarts"] == 0 for r in fleet.replicas())
    kinds = [e["kind"] for e in fleet.status()["events"]]
    assert kinds.count("replica-adopted") == 3 and "replica-placed" not in kinds
    assert fleet.chat("big").status_code == 200


def test_idle_model_scales_to_zero_and_a_request_wakes_it(fleet):
    (fleet.catalogs / "lazy.yaml").write_text(
        "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: lazy\n    replicas: {min: 0, max: 1}\n"
        "    idle_timeout: 3s\n    profiles: [{engine: fake, gpus: 0, pool: a100, args: [--startup-delay, '0.5']}]\n")
    seen = wait_until(lambda: (s := fleet.status())["settled"] and any(m["name"] == "lazy" for m in s["models"]) and s,
                      "lazy in the catalog")
    # A pass runs whole on the controller's loop, between two status answers:
    # one numbered past this status began with lazy in the catalog, and decided
    # about it. Two such passes, so a start put off by one pass shows too.
    wait_until(lambda: fleet.status()["passes"] > seen["passes"] + 1, "two reconcile passes with lazy in the catalog")
    assert fleet.replicas("lazy") == [], "a min-0 model nobody asked for was started"
    reply = fleet.chat("lazy", timeout=60)   # held by the router through the cold start
    assert reply.status_code == 200, reply.text
    wait_until(lambda: not fleet.replicas("lazy"), "lazy scaled back to zero after its idle timeout", timeout=30)
    assert any(e["kind"] == "scale-down" and e["message"].startswith("lazy") for e in fleet.status()["events"])


def test_lost_agent_replicas_leave_the_router_and_are_replaced(fleet):
    (victim,) = fleet.ready("anywhere")
    lost, other = victim["node"], "n1" if victim["node"] == "n2" else "n2"
    agent = fleet.agents[lost]
    agent.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: {n["name"]: n["state"] for n in fleet.status()["nodes"]}[lost] == "unreachable", "node lost")
        wait_until(lambda: any(r["node"] == other for r in fleet.ready("anywhere")), "replacement on the other node")
        reply = fleet.chat("anywhere")
        assert reply.status_code == 200 and reply.headers["x-llmgw-replica"] != victim["id"]
    finally:
        agent.send_signal(signal.SIGCONT)
    # Back again: the replica given up on is stopped, not kept as a duplicate.
    wait_until(lambda: {n["name"]: n["state"] for n in fleet.status()["nodes"]}[lost] == "ready", "node back")
    wait_until(lambda: len(fleet.replicas("anywhere")) == 1 and fleet.replicas("anywhere")[0]["node"] == other,
               "no duplicate of anywhere")
