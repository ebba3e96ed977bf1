"""The control API's tokens against a real `llmgwctl serve`, real agents and a real standalone router.

A refused request must change nothing: no catalog file written, no node in
the inventory, nothing started.
"""
from __future__ import annotations

import os

import pytest
import requests
from click.testing import CliRunner

from llmgwctl.cli import main as cli_main
from llmgwctl.control.auth import ControlAuth, TokenError, check_bind, is_loopback, node_token, read_token_file
from tests.e2e.fleet import Fleet, wait_until, write_secret

ADMIN = "admin-" + "1f" * 16
AGENT = "agent-" + "2e" * 16
WRONG = "wrong-" + "3d" * 16
GOOD_NODE = node_token(AGENT, "tok-good")      # agents authenticate as their node

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: tok-model
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
NEW_FILE = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: tok-extra
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
REPORT = {"boot_id": "b", "pools": [], "engines": {"fake": [True, ""]}, "gpus": [], "replicas": []}


def bearer(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok-fleet")
    fleet = Fleet(root)
    fleet.admin_token = ADMIN
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    for name, token in (("admin.token", ADMIN), ("agent.token", AGENT), ("wrong.token", WRONG),
                        ("tok-good.token", GOOD_NODE)):
        write_secret(root / name, token)
    try:
        fleet.start_controller("--token-file", str(root / "admin.token"),
                               "--agent-token-file", str(root / "agent.token"))
        yield fleet
    finally:
        fleet.close_waiting()


def start_agent(fleet, node: str, token_file: str) -> None:
    fleet.agents[node] = fleet._spawn(f"agent-{node}", [
        "agent", "--controller", fleet.control, "--node", node, "--gpus", "none",
        "--state-dir", str(fleet.root / f"state-{node}"), "--heartbeat", "0.5",
        "--token-file", str(fleet.root / token_file)])


@pytest.mark.parametrize("token", [None, WRONG, AGENT])
def test_admin_routes_refuse_a_missing_wrong_or_agent_token(fleet, token):
    for path in ("/api/v1/status", "/api/v1/catalog", "/metrics"):
        resp = requests.get(fleet.control + path, headers=bearer(token), timeout=10)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    before = sorted(os.listdir(fleet.catalogs))
    resp = requests.post(fleet.control + "/api/v1/catalog", headers=bearer(token), timeout=10,
                         json={"filename": "extra.yaml", "content": NEW_FILE})
    assert resp.status_code == 401
    assert sorted(os.listdir(fleet.catalogs)) == before                # nothing written
    assert "tok-extra" not in {m["name"] for m in fleet.status()["models"]}


@pytest.mark.parametrize("token", [None, WRONG])
def test_agent_routes_refuse_a_missing_or_wrong_token_and_change_nothing(fleet, token):
    resp = requests.post(fleet.control + "/api/v1/agents/intruder/report", headers=bearer(token), timeout=10,
                         json={**REPORT, "node": "intruder"})
    assert resp.status_code == 401
    assert "intruder" not in {n["name"] for n in fleet.status()["nodes"]}
    for path in ("/api/v1/agents/intruder/desired?timeout=0", "/api/v1/watch/endpoints?timeout=0"):
        assert requests.get(fleet.control + path, headers=bearer(token), timeout=10).status_code == 401
    resp = requests.post(fleet.control + "/api/v1/wake", headers=bearer(token), json={"model": "tok-model"},
                         timeout=10)
    assert resp.status_code == 401


def test_probes_stay_open(fleet):
    assert requests.get(fleet.control + "/healthz", timeout=10).status_code == 200
    assert requests.get(fleet.control + "/readyz", timeout=10).status_code in (200, 503)


def test_the_admin_token_applies_a_catalog(fleet):
    resp = requests.post(fleet.control + "/api/v1/catalog?dry_run=1", headers=bearer(ADMIN), timeout=30,
                         json={"filename": "extra.yaml", "content": NEW_FILE})
    assert resp.status_code == 200 and resp.json()["dry_run"] is True


def test_agents_with_their_token_join_and_with_a_wrong_one_do_not(fleet):
    start_agent(fleet, "tok-good", "tok-good.token")
    start_agent(fleet, "tok-bad", "wrong.token")
    wait_until(lambda: any(n["name"] == "tok-good" and n["reports"] >= 3 for n in fleet.status()["nodes"]),
               "the agent with the agent token to report three times")
    wait_until(lambda: [r for r in fleet.status()["replicas"] if r["model"] == "tok-model" and r["state"] == "ready"],
               "tok-model ready on the good agent")
    assert "tok-bad" not in {n["name"] for n in fleet.status()["nodes"]}
    wait_until(lambda: "HTTP 401" in fleet.log("agent-tok-bad"), "the refused agent to say why")


def test_a_standalone_router_follows_with_the_agent_token(fleet):
    url = fleet.start_router("--token-file", str(fleet.root / "agent.token"))
    wait_until(lambda: requests.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "tok-model", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200,
        "a reply through the standalone router")


def test_status_command_sends_the_token_from_the_environment(fleet):
    runner = CliRunner()
    refused = runner.invoke(cli_main, ["status", "--controller", fleet.control], env={"LLMGW_TOKEN": ""})
    assert refused.exit_code == 1 and "401" in refused.output and "LLMGW_TOKEN" in refused.output
    ok = runner.invoke(cli_main, ["status", "--controller", fleet.control, "-o", "json"], env={"LLMGW_TOKEN": ADMIN})
    assert ok.exit_code == 0, ok.output
    assert "tok-model" in ok.output


def test_engine_logs_need_the_admin_token_and_come_from_the_replicas_own_node(fleet):
    (replica,) = [r for r in fleet.status()["replicas"] if r["model"] == "tok-model"]
    url = f"{fleet.control}/api/v1/replicas/{replica['id']}/logs"
    # Reading a log is the admin's: engines print prompts in some debug modes.
    for token in (None, WRONG, AGENT, GOOD_NODE):
        assert requests.get(url, headers=bearer(token), timeout=10).status_code == 401, token
    # Relayed by the agent that authenticated with its node token.
    runner = CliRunner()
    out = runner.invoke(cli_main, ["logs", replica["id"], "--controller", fleet.control], env={"LLMGW_TOKEN": ADMIN})
    assert out.exit_code == 0, out.output
    assert "fake engine serving tok-model" in out.output
    # A node token answers only on its own node's path; the agent token on none.
    other = node_token(AGENT, "tok-other")
    for token, code in ((other, 403), (AGENT, 403), (None, 401)):
        resp = requests.post(f"{fleet.control}/api/v1/agents/tok-good/logs/0123456789abcdef01234567",
                             json={"lines": ["forged"]}, headers=bearer(token), timeout=10)
        assert resp.status_code == code, (token, resp.text)
    # Its own node's path, for a request the controller never made: nobody reads it.
    resp = requests.post(f"{fleet.control}/api/v1/agents/tok-good/logs/0123456789abcdef01234567",
                         json={"lines": ["forged"]}, headers=bearer(GOOD_NODE), timeout=10)
    assert resp.status_code == 410


def test_tokens_never_reach_the_logs(fleet):
    # Runs after the refusals above: they were logged, the tokens were not.
    text = "".join(fleet.log(name) for name in ("controller", "agent-tok-good", "agent-tok-bad", "router-0"))
    assert "refused" in text
    for token in (ADMIN, AGENT, WRONG, GOOD_NODE):
        assert token not in text


# -- the rules, without a server -------------------------------------------------------

def test_binding_beyond_loopback_needs_a_token(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("gpu-head")
    with pytest.raises(TokenError, match="without a token"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", ADMIN)
    check_bind("127.0.0.1", None)
    # The CLI refuses before binding anything (exit 2, a usage error).
    (tmp_path / "cat").mkdir()
    result = CliRunner().invoke(cli_main, ["serve", "--catalogs", str(tmp_path / "cat"), "--control", "0.0.0.0:0"])
    assert result.exit_code == 2 and "without a token" in result.output


def test_token_files_must_hold_a_real_token(tmp_path):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "short").write_text("hunter2\n")
    with pytest.raises(TokenError, match="empty"):
        read_token_file(tmp_path / "empty")
    with pytest.raises(TokenError, match="at least 16"):
        read_token_file(tmp_path / "short")
    with pytest.raises(TokenError, match="cannot read"):
        read_token_file(tmp_path / "missing")
    with pytest.raises(TokenError, match="needs an admin token"):
        ControlAuth(None, AGENT)


def test_the_agent_token_is_good_only_on_router_routes_and_a_node_token_on_its_node():
    # Changed on purpose (issue 13): the agent token no longer acts as any node.
    auth = ControlAuth(ADMIN, AGENT)
    node = node_token(AGENT, "n1")
    for path in ("/api/v1/agents/n1/report", "/api/v1/agents/n1/desired"):
        assert auth.allowed(path, f"Bearer {node}") and auth.allowed(path, f"Bearer {ADMIN}")
        assert auth.check(path, f"Bearer {AGENT}").status == 403
        assert not auth.allowed(path, f"Bearer {WRONG}") and not auth.allowed(path, None)
    for path in ("/api/v1/watch/endpoints", "/api/v1/wake", "/api/v1/usage"):
        assert auth.allowed(path, f"Bearer {AGENT}") and auth.allowed(path, f"Bearer {ADMIN}")
        assert not auth.allowed(path, f"Bearer {node}")
        assert not auth.allowed(path, f"Bearer {WRONG}") and not auth.allowed(path, None)
    for path in ("/api/v1/status", "/api/v1/catalog", "/metrics"):
        assert not auth.allowed(path, f"Bearer {AGENT}") and not auth.allowed(path, f"Bearer {node}")
        assert auth.allowed(path, f"Bearer {ADMIN}")
    assert ControlAuth().allowed("/api/v1/catalog", None)        # loopback without a token: open
