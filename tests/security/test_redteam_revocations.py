"""A broken node revocation list shows in status, not only in serve's log.

The revocation list is the one followed file whose failure lets an attacker
in: an operator revokes a stolen node token with a typo on the line, the
list is not applied, and the token keeps working. Every other followed file
(the catalog directory, the API key file) is a row of status' `watchers`,
`degraded` with the reason while it is not in force; the revocation list
was only logged, so `llmgwctl status` and the console said all was well.
Against a real `llmgwctl serve`: the list broken shows `degraded` naming
the line, the last good list stays in force, and the fixed list is `ok`.
"""
from __future__ import annotations

import requests

from llmgwctl.control.auth import node_token
from tests.e2e.fleet import Fleet, wait_until, write_secret

ADMIN = "admin-" + "5c" * 16
AGENT = "agent-" + "6d" * 16
CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: chat
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def row(fleet: Fleet) -> dict | None:
    return next((w for w in fleet.status()["watchers"] if w["name"] == "node-revocations"), None)


def reports(token: str, fleet: Fleet) -> int:
    return requests.post(f"{fleet.control}/api/v1/agents/stolen/report", timeout=30,
                         json={"node": "stolen", "gpus": [], "replicas": []},
                         headers={"Authorization": f"Bearer {token}"}).status_code


def test_a_broken_revocation_list_is_degraded_in_status(tmp_path):
    fleet = Fleet(tmp_path)
    fleet.admin_token = ADMIN
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    write_secret(tmp_path / "admin.token", ADMIN)
    write_secret(tmp_path / "agent.token", AGENT)
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("stolen\n")
    stolen = node_token(AGENT, "stolen")
    try:
        fleet.start_controller("--token-file", str(tmp_path / "admin.token"),
                               "--agent-token-file", str(tmp_path / "agent.token"),
                               "--node-revocations", str(revoked))
        first = wait_until(lambda: row(fleet), "the revocation list among status' watchers")
        assert first["state"] == "ok" and first["path"] == str(revoked), first
        assert reports(stolen, fleet) == 401

        revoked.write_text("stolen\nother 1 2\n")       # the operator's typo: three words on a line
        broken = wait_until(lambda: (r := row(fleet)) and r["state"] == "degraded" and r, "the broken list degraded")
        assert "revoked.txt:2" in broken["problem"] and broken["failures"] == 1, broken
        assert reports(stolen, fleet) == 401, "the last list read stays in force"

        revoked.write_text("stolen\nother 2\n")
        wait_until(lambda: (r := row(fleet)) and r["state"] == "ok", "the fixed list back in force")
        assert reports(stolen, fleet) == 401
    finally:
        fleet.close_waiting()
