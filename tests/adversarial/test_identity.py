"""Nodes have identities, against a real `llmgwctl serve`, real agents and a real standalone router.

An attacker here holds the agent token or one node's token and tries to be
another node, read another node's desired list (env included), or point the
router at a machine of its choosing; an operator starts a second agent for a
node by mistake. Each attempt is refused with a status and a message that
says why, and changes nothing: no node, no replica, no engine.

The controller runs with a 30 s node timeout (not the fleet's 2 s) so a
restarted agent that takes its node over must do it by proving it succeeds
the old one, not by waiting for the node to time out.
"""
from __future__ import annotations

import json
import re
import signal
import stat
import subprocess

import pytest
import requests

from llmgwctl.control.auth import node_token
from llmgwctl.router.auth import hash_key
from tests.e2e.fleet import Fleet, wait_until, write_secret

ADMIN = "admin-" + "4a" * 16
AGENT = "agent-" + "5b" * 16
API_KEY = "sk-ident-" + "6c" * 16
NODE_TIMEOUT = 30.0
WAIT = 90.0          # one node timeout plus a replacement's start, on a loaded 2-core machine

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: dup-model
    profiles: [{name: cpu, engine: fake, gpus: 0, pool: dup}]
  - name: rst-model
    profiles: [{name: cpu, engine: fake, gpus: 0, pool: rst}]
"""


def bearer(token: str, scheme: str = "Bearer") -> dict:
    return {"Authorization": f"{scheme} {token}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    fleet = Fleet(root)
    fleet.admin_token = ADMIN
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    files = {"admin.token": ADMIN, "agent.token": AGENT,
             "keys.yaml": f"keys:\n  - {{name: ident, sha256: {hash_key(API_KEY)}, models: ['*'], rpm: 1000}}\n"}
    for node in ("dup", "rst", "n-url", "n-a"):
        files[f"{node}.token"] = node_token(AGENT, node)
    for name, text in files.items():
        write_secret(root / name, text)
    try:
        # The last --node-timeout wins over the fleet's own 2 s.
        fleet.start_controller("--token-file", str(root / "admin.token"), "--agent-token-file",
                               str(root / "agent.token"), "--api-keys", str(root / "keys.yaml"),
                               "--node-timeout", str(NODE_TIMEOUT))
        yield fleet
    finally:
        fleet.close_waiting()


def node_line(fleet, name: str) -> dict | None:
    return next((n for n in fleet.status()["nodes"] if n["name"] == name), None)


def agent(fleet, name: str, node: str, state: str, ports: str, token_file: str | None = None) -> subprocess.Popen:
    """A real `llmgwctl agent` for `node` (with its node token unless told); logs to NAME.log."""
    proc = fleet._spawn(name, [
        "agent", "--controller", fleet.control, "--node", node, "--gpus", "none", "--pool", node,
        "--state-dir", str(fleet.root / state), "--ports", ports, "--heartbeat", "0.5", "--grace", "3",
        "--token-file", str(fleet.root / (token_file or f"{node}.token"))])
    fleet.agents[name] = proc
    return proc


def ports(fleet, slot: int) -> str:
    base = fleet._port_base + 10 * slot
    return f"{base}-{base + 9}"


def ready_on(fleet, model: str, node: str) -> list[dict]:
    return [r for r in fleet.status()["replicas"] if r["model"] == model and r["node"] == node and r["state"] == "ready"]


def post_report(fleet, node: str, token: str, body: dict) -> requests.Response:
    return requests.post(f"{fleet.control}/api/v1/agents/{node}/report", headers=bearer(token), timeout=10,
                         json={"node": node, "gpus": [], "replicas": [], "pools": [node], **body})


# -- a token is one node ---------------------------------------------------------------------

def test_the_agent_token_and_another_nodes_token_cannot_report_a_node(fleet):
    ready_at = {"id": "spoof-1", "spec_hash": "x", "model": "dup-model", "profile": "cpu", "engine": "fake",
                "state": "ready", "port": 20001, "url": "http://127.0.0.1:20001"}
    by_agent = post_report(fleet, "intruder", AGENT, {"replicas": [ready_at]})
    assert by_agent.status_code == 403, by_agent.text
    assert "llmgwctl token node intruder" in by_agent.json()["error"]["message"]
    by_other = post_report(fleet, "intruder", node_token(AGENT, "n-a"), {"replicas": [ready_at]})
    assert by_other.status_code == 403, by_other.text
    assert "node 'n-a'" in by_other.json()["error"]["message"]
    seen = fleet.status()
    assert "intruder" not in {n["name"] for n in seen["nodes"]}
    assert "spoof-1" not in {r["id"] for r in seen["replicas"]}


def test_a_node_cannot_read_another_nodes_desired_list(fleet):
    for token in (AGENT, node_token(AGENT, "n-a")):
        resp = requests.get(f"{fleet.control}/api/v1/agents/rst/desired?timeout=0", headers=bearer(token), timeout=10)
        assert resp.status_code == 403, resp.text
        assert "replicas" not in resp.json()


def test_a_replica_url_off_the_nodes_host_is_refused(fleet):
    elsewhere = {"id": "stray-1", "spec_hash": "x", "model": "not-in-catalog", "state": "ready", "port": 20001,
                 "url": "http://192.0.2.10:20001"}
    token = node_token(AGENT, "n-url")
    advertised = post_report(fleet, "n-url", token, {"advertise_host": "127.0.0.1", "replicas": [elsewhere]})
    assert advertised.status_code == 400 and "replicas[0].url" in advertised.json()["error"]["message"]
    # Advertising no host: the URL must be on the address the report came from (127.0.0.1 here).
    unadvertised = post_report(fleet, "n-url", token, {"replicas": [elsewhere]})
    assert unadvertised.status_code == 400
    assert "the address the report came from" in unadvertised.json()["error"]["message"]
    assert "n-url" not in {n["name"] for n in fleet.status()["nodes"]}
    # The same report with the URL on the node's own host is taken.
    at_home = dict(elsewhere, url="http://127.0.0.1:20001")
    assert post_report(fleet, "n-url", token, {"advertise_host": "127.0.0.1", "replicas": [at_home]}).ok
    assert node_line(fleet, "n-url") is not None


# -- one agent process per node ---------------------------------------------------------------
# These agents present the admin token: who speaks for a node does not depend on
# the credential -- not even the admin token lets a second agent in.

def test_a_second_agent_for_a_running_node_is_refused_shown_and_takes_over_when_the_first_is_gone(fleet):
    first = agent(fleet, "dup-1", "dup", "state-dup-1", ports(fleet, 0), "admin.token")
    (replica,) = wait_until(lambda: ready_on(fleet, "dup-model", "dup"), "dup-model ready on the first agent", WAIT)

    agent(fleet, "dup-2", "dup", "state-dup-2", ports(fleet, 1), "admin.token")
    line = wait_until(lambda: (n := node_line(fleet, "dup")) and n["conflict"] and n, "the conflict in status", WAIT)
    assert "already has a running agent" in line["conflict"]
    assert "node-conflict" in {e["kind"] for e in fleet.status()["events"]}
    wait_until(lambda: "HTTP 409" in fleet.log("dup-2"), "the second agent to say it was refused")
    # Refused means told nothing: it got no desired list and started no engine.
    assert "desired version" not in fleet.log("dup-2")
    assert [r["id"] for r in fleet.status()["replicas"] if r["model"] == "dup-model"] == [replica["id"]]
    saved = fleet.root / "state-dup-2" / "replicas.json"
    assert not saved.exists() or json.loads(saved.read_text())["replicas"] == []

    # The first one dies: once the node times out, the second speaks for it and runs its replica.
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    wait_until(lambda: [r for r in ready_on(fleet, "dup-model", "dup") if r["pid"] != replica["pid"]],
               "dup-model ready again, started by the second agent", WAIT + NODE_TIMEOUT)
    assert node_line(fleet, "dup")["conflict"] is None
    assert json.loads(saved.read_text())["replicas"], "the second agent runs it now"


def test_a_restarted_agent_takes_its_node_over_at_once_and_adopts_its_engines(fleet):
    first = agent(fleet, "rst-1", "rst", "state-rst", ports(fleet, 2), "admin.token")
    (replica,) = wait_until(lambda: ready_on(fleet, "rst-model", "rst"), "rst-model ready", WAIT)

    # While it lives, a second agent on its state directory does not start at all.
    second = agent(fleet, "rst-copy", "rst", "state-rst", ports(fleet, 3), "admin.token")
    assert second.wait(timeout=60) == 1
    assert "in use by another agent" in fleet.log("rst-copy")
    # Private to the agent's user: engine logs hold what engines print about requests.
    state_dir = fleet.root / "state-rst"
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    logs = list((state_dir / "logs").glob("*.log"))
    assert logs and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in logs)

    # kill -9 and start again at once, well inside the 30 s node timeout.
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    before = node_line(fleet, "rst")["reports"]
    agent(fleet, "rst-2", "rst", "state-rst", ports(fleet, 2), "admin.token")
    wait_until(lambda: "adopted pid" in fleet.log("rst-2"), "the restarted agent to adopt its engine", WAIT)
    # Refused reports are not counted: these prove the controller took the new agent's word.
    wait_until(lambda: node_line(fleet, "rst")["reports"] >= before + 3, "the restarted agent's reports to be taken",
               NODE_TIMEOUT / 2)
    (after,) = wait_until(lambda: ready_on(fleet, "rst-model", "rst"), "rst-model ready", WAIT)
    assert after["id"] == replica["id"] and after["pid"] == replica["pid"], "adopted, not restarted"
    events = fleet.status()["events"]
    assert not [e for e in events if e["message"].startswith(("node rst ", "node 'rst'"))], events
    assert "HTTP 409" not in fleet.log("rst-2")


# -- routers and the bearer scheme ---------------------------------------------------------------

def test_a_standalone_router_with_the_agent_token_reports_its_usage(fleet):
    fleet.start_router("--token-file", str(fleet.root / "agent.token"))
    wait_until(lambda: fleet.status()["routers"] >= 1, "the controller to count the router's usage reports", WAIT)
    # A 401 as a word: the router's own port in its log line may hold the digits (":40175").
    assert not re.search(r"\b401\b", fleet.log("router-0"))


def test_a_lower_case_bearer_scheme_is_accepted(fleet):
    for scheme in ("bearer", "BEARER"):
        resp = requests.get(fleet.control + "/api/v1/status", headers=bearer(ADMIN, scheme), timeout=10)
        assert resp.status_code == 200, resp.text
    wait_until(lambda: ready_on(fleet, "rst-model", "rst"), "rst-model ready", WAIT)
    reply = requests.post(fleet.router + "/v1/chat/completions", headers=bearer(API_KEY, "bearer"), timeout=30,
                          json={"model": "rst-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200, reply.text


# -- serve's own agent ------------------------------------------------------------------------------

def test_serves_local_agent_authenticates_as_its_node(tmp_path):
    """In-process, the local agent still speaks the agent protocol: with its node's token, minted by serve."""
    fleet = Fleet(tmp_path)
    fleet.admin_token = ADMIN
    (fleet.catalogs / "models.yaml").write_text(CATALOG.replace("pool: rst", "pool: local"))
    for name, token in (("admin.token", ADMIN), ("agent.token", AGENT)):
        write_secret(tmp_path / name, token)
    try:
        fleet.start_serve("--node", "head", "--pool", "local", "--token-file", str(tmp_path / "admin.token"),
                          "--agent-token-file", str(tmp_path / "agent.token"))
        wait_until(lambda: ready_on(fleet, "rst-model", "head"), "rst-model ready on serve's own agent", WAIT)
        # ... which the agent token itself could not have done.
        resp = requests.get(fleet.control + "/api/v1/agents/head/desired?timeout=0", headers=bearer(AGENT), timeout=10)
        assert resp.status_code == 403, resp.text
        # A 403 the local agent got, not a port number that happens to hold the digits.
        assert not re.search(r"(?<![:\d])403(?!\d)", fleet.log("serve")), fleet.log("serve")[-2000:]
    finally:
        fleet.close_waiting("every process of serve to exit")
