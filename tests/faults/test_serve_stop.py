"""`serve` stopped with SIGTERM never re-places its own replicas elsewhere (issue 15).

serve's local agent stops its node's engines on the way out. The reconcile
loop used to go on meanwhile, see those replicas stopping, and place them
again on a remote node; the restarted serve then adopted that drift (both
replicas on the remote node, none on its own). Now the loop stops first.
"""
import signal

from tests.e2e.fleet import wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def spread(fleet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in fleet.replicas("talk"):
        out.setdefault(r["node"], []).append(r["id"])
    return out


def test_sigterm_stops_local_replicas_without_placing_them_on_a_remote_node(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    fleet.start_serve("--node", "local", "--settle", "2")
    fleet.start_agent("n2", "none")
    wait_until(lambda: len(fleet.ready("talk")) == 2, "both replicas ready")
    before = spread(fleet)
    assert sorted(before) == ["local", "n2"], before
    fleet.controller.send_signal(signal.SIGTERM)
    assert fleet.controller.wait(timeout=60) == 0, fleet.log("serve")[-2000:]
    assert "replica-placed" not in fleet.log("serve").split("shutting down", 1)[1], "placed something on the way out"
    fleet.start_serve("--node", "local", "--settle", "2")
    wait_until(lambda: len(fleet.ready("talk")) == 2, "both replicas ready after the restart")
    after = spread(fleet)
    figure(f"before SIGTERM {before}; after the restart {after}")
    assert after["n2"] == before["n2"], "the remote node's replicas changed across serve's restart"
    assert len(after.get("local", ())) == 1
