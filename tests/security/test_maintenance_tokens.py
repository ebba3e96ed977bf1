"""Cordon and drain are the operator's: against a real `llmgwctl serve` with tokens and a real agent.

A node's own token may report and follow its desired list; it must not
cordon, drain or uncordon anything, its own node included (a compromised
machine must not be able to move the fleet's replicas around), and neither
may a router's agent token. A refused request changes nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests

from llmgwctl.control.auth import node_token
from tests.e2e.fleet import Fleet, wait_until, write_secret

ADMIN = "admin-" + "4c" * 16
AGENT = "agent-" + "5b" * 16
NODE = "mt-node"
CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: mt-model
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("maintenance-tokens")
    fleet = Fleet(root)
    fleet.admin_token = ADMIN
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    write_secret(root / "admin.token", ADMIN)
    write_secret(root / "agent.token", AGENT)
    write_secret(root / "node.token", node_token(AGENT, NODE))
    try:
        fleet.start_controller("--token-file", str(root / "admin.token"), "--agent-token-file",
                               str(root / "agent.token"), "--state-dir", str(root / "state-controller"))
        fleet.agents[NODE] = fleet._spawn(f"agent-{NODE}", [
            "agent", "--controller", fleet.control, "--node", NODE, "--gpus", "none",
            "--state-dir", str(root / f"state-{NODE}"), "--heartbeat", "0.5", "--token-file", str(root / "node.token")])
        wait_until(lambda: [n["name"] for n in fleet.status()["nodes"]] == [NODE], "the node reporting")
        yield fleet
    finally:
        fleet.close_waiting()


@pytest.mark.parametrize("who", ["nobody", "router", "the node itself"])
@pytest.mark.parametrize("verb", ["cordon", "drain", "uncordon"])
def test_only_the_admin_token_may_cordon_drain_or_uncordon(fleet, who, verb):
    token = {"nobody": None, "router": AGENT, "the node itself": node_token(AGENT, NODE)}[who]
    resp = requests.post(f"{fleet.control}/api/v1/nodes/{NODE}/{verb}", json={}, headers=bearer(token), timeout=10)
    # As on every admin route: a token that is not the admin's is no valid token here (401);
    # a node's token on a route that is not its node's is 403 (auth.ControlAuth).
    assert resp.status_code in ((401,) if token != node_token(AGENT, NODE) else (401, 403)), resp.text
    node = next(n for n in fleet.status()["nodes"] if n["name"] == NODE)
    assert node["scheduling"] == "schedulable", "a refused request changed nothing"
    assert not (fleet.root / "state-controller" / "controller" / "node-holds.json").exists()


def test_the_cli_sends_the_admin_token(fleet):
    env = {**os.environ, "LLMGW_TOKEN": ADMIN}
    for verb, state in (("cordon", "cordoned"), ("uncordon", "schedulable")):
        out = subprocess.run([sys.executable, "-m", "llmgwctl", verb, NODE, "--controller", fleet.control],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert next(n for n in fleet.status()["nodes"] if n["name"] == NODE)["scheduling"] == state
    denied = subprocess.run([sys.executable, "-m", "llmgwctl", "cordon", NODE, "--controller", fleet.control],
                            capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k not in ("LLMGW_TOKEN", "LLMGW_TOKEN_FILE")})
    assert denied.returncode == 1 and "HTTP 401" in denied.stderr
