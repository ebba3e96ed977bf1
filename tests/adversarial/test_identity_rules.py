"""Node identity, rule by rule, without processes: tokens, who speaks for a node, replica URLs.

The end-to-end counterparts, with a real `llmgwctl serve` and real agents,
are in test_identity.py. Time here is a fake clock, so "unreachable" is exact.
"""
from __future__ import annotations

import os

import pytest

from llmgwctl.control.api import replica_url_problem
from llmgwctl.control.auth import ControlAuth, TokenError, node_token
from llmgwctl.inventory import ConflictError, Inventory
from tests.reconciler.test_reconciler import World, catalog, converge, model
from tests.support import FakeClock

ADMIN = "admin-" + "1f" * 16
AGENT = "agent-" + "2e" * 16


def report(instance, boot="boot-1", previous="", **extra):
    return {"gpus": [], "replicas": [], "instance_id": instance, "boot_id": boot,
            "previous_instance_id": previous, **extra}


# -- tokens -------------------------------------------------------------------------

def test_a_node_token_is_good_for_its_node_only():
    auth = ControlAuth(ADMIN, AGENT)
    a = node_token(AGENT, "gpu-a")
    assert a.startswith("llmgwn.gpu-a.")
    assert auth.check("/api/v1/agents/gpu-a/report", f"Bearer {a}") is None
    refused = auth.check("/api/v1/agents/gpu-b/desired", f"Bearer {a}")
    assert refused.status == 403 and "'gpu-a'" in refused.message and "'gpu-b'" in refused.message
    # The router's match (decoded) wins over the raw path when given.
    assert auth.check("/api/v1/agents/x/report", f"Bearer {a}", node="gpu-a") is None


def test_a_forged_or_foreign_node_token_is_no_token():
    auth = ControlAuth(ADMIN, AGENT)
    genuine = node_token(AGENT, "gpu-a")
    forged = genuine[:-1] + ("0" if genuine[-1] != "0" else "1")
    other_secret = node_token("another-secret-" + "9" * 20, "gpu-a")
    renamed = genuine.replace("gpu-a", "gpu-b", 1)          # the MAC covers the name
    for token in (forged, other_secret, renamed, "llmgwn.", "llmgwn..", "llmgwn.gpu-a"):
        assert auth.check("/api/v1/agents/gpu-a/report", f"Bearer {token}").status == 401, token
        assert auth.check("/api/v1/agents/gpu-b/report", f"Bearer {token}").status == 401, token


def test_the_agent_token_is_told_to_mint_a_node_token():
    refused = ControlAuth(ADMIN, AGENT).check("/api/v1/agents/gpu-a/report", f"Bearer {AGENT}")
    assert refused.status == 403 and "llmgwctl token node gpu-a" in refused.message


def test_the_admin_token_still_acts_for_any_node():
    assert ControlAuth(ADMIN, AGENT).check("/api/v1/agents/anything/report", f"Bearer {ADMIN}") is None


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_the_scheme_is_case_insensitive(scheme):
    auth = ControlAuth(ADMIN, AGENT)
    assert auth.allowed("/api/v1/status", f"{scheme} {ADMIN}")
    assert auth.allowed("/api/v1/usage", f"{scheme} {AGENT}")
    assert not auth.allowed("/api/v1/status", f"{scheme}{ADMIN}")      # still needs the space
    assert not auth.allowed("/api/v1/status", f"Basic {ADMIN}")


def test_the_router_key_scheme_is_case_insensitive(tmp_path):
    from llmgwctl.router.auth import hash_key, load_keys
    key = "sk-lower-" + "7" * 32
    (tmp_path / "keys.yaml").write_text(f"keys:\n  - {{name: low, sha256: {hash_key(key)}, models: ['*'], rpm: 5}}\n")
    keys = load_keys(tmp_path / "keys.yaml")
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert keys.lookup(f"{scheme} {key}").name == "low"


@pytest.mark.parametrize("name", ["", "a/b", "a b", "a?b", "a%2fb", "tab\there"])
def test_node_names_that_cannot_be_one_path_segment_get_no_token(name):
    with pytest.raises(TokenError):
        node_token(AGENT, name)


# -- who speaks for a node --------------------------------------------------------------

def test_a_second_agent_for_a_reachable_node_is_refused_then_takes_over_once_it_is_unreachable():
    clock = FakeClock()
    inv = Inventory(clock=clock, unreachable_after=15)
    inv.report("n", report("first"))
    clock.advance(5)
    with pytest.raises(ConflictError) as refused:
        inv.report("n", report("second"))
    assert refused.value.first and "already has a running agent" in str(refused.value)
    assert inv.holder("n") == "first" and "second"[:12] in inv.conflict(inv.get("n"))
    clock.advance(1)
    with pytest.raises(ConflictError) as again:
        inv.report("n", report("second"))
    assert not again.value.first                     # one event per claimant, not per heartbeat
    inv.report("n", report("first"))                 # the holder goes on as before
    clock.advance(16)                                  # ... then falls silent past the timeout
    assert inv.holder("n") is None
    inv.report("n", report("second"))
    assert inv.holder("n") == "second" and inv.conflict(inv.get("n")) is None


def test_a_restarted_agent_takes_over_at_once_with_proof_from_its_state_directory():
    clock = FakeClock()
    inv = Inventory(clock=clock, unreachable_after=15)
    inv.report("n", report("old"))
    clock.advance(1)
    inv.report("n", report("new", previous="old"))
    assert inv.holder("n") == "new"


@pytest.mark.parametrize("proof", [
    {"previous": "someone-else"},                   # not the holder's successor
    {"previous": "old", "boot": "boot-2"},          # a copy of the holder's state dir on another machine
    {"previous": ""},                               # a fresh state directory
])
def test_without_the_whole_proof_a_new_agent_waits(proof):
    clock = FakeClock()
    inv = Inventory(clock=clock, unreachable_after=15)
    inv.report("n", report("old"))
    clock.advance(1)
    with pytest.raises(ConflictError):
        inv.report("n", report("new", **proof))
    assert inv.holder("n") == "old"


def test_agents_before_instance_ids_are_told_apart_by_their_per_start_boot_id():
    clock = FakeClock()
    inv = Inventory(clock=clock, unreachable_after=15)
    inv.report("n", {"gpus": [], "replicas": [], "boot_id": "uuid-of-run-1"})
    inv.report("n", {"gpus": [], "replicas": [], "boot_id": "uuid-of-run-1"})
    with pytest.raises(ConflictError):
        inv.report("n", {"gpus": [], "replicas": [], "boot_id": "uuid-of-run-2"})


def test_the_refusal_shows_on_the_node_in_status_while_the_second_agent_keeps_trying():
    w = World(catalog(model("a")))
    w.inventory.report("n1", report("first"))
    with pytest.raises(ConflictError):
        w.inventory.report("n1", report("second"))
    (node,) = w.rec.fleet_status().nodes
    assert "already has a running agent" in node.conflict
    assert w.rec.status()["nodes"][0]["conflict"] == node.conflict
    w.clock.advance(10)
    w.inventory.report("n1", report("first"))           # the holder goes on; the second one gave up
    w.clock.advance(10)
    assert w.rec.fleet_status().nodes[0].conflict is None
    assert w.rec.status()["nodes"][0]["conflict"] is None


def test_a_replica_reported_by_a_second_node_is_not_adopted_twice():
    w = World(catalog(model("a")), settle=0)     # placed at once: this is about the claim, not the settling window
    converge(w, ("n1",))
    (rid,) = w.rec.replicas
    copied = dict(w.running["n1"][rid], url="http://127.0.0.1:29999")
    w.running["n2"] = {rid: copied}
    w.report("n2")
    w.step()
    w.step()
    rec = w.rec.replicas[rid]
    assert rec.node == "n1" and rec.url != "http://127.0.0.1:29999"
    assert [e.kind for e in w.rec.events].count("replica-conflict") == 1
    assert {e.url for e in w.sink.pushes[-1]} == {rec.url}


# -- replica URLs ------------------------------------------------------------------------

def rep(url, port=20001):
    return {"id": "r", "spec_hash": "h", "model": "m", "state": "ready", "url": url, "port": port}


@pytest.mark.parametrize("body,remote,wanted", [
    ({"advertise_host": "10.0.0.7", "replicas": [rep("http://10.0.0.8:20001")]}, "10.0.0.7", "replicas[0].url"),
    ({"advertise_host": "10.0.0.7", "replicas": [rep("http://10.0.0.7:20001"), rep("http://evil:20001")]},
     "10.0.0.7", "replicas[1].url"),
    ({"replicas": [rep("http://10.0.0.8:20001")]}, "10.0.0.7", "the address the report came from"),
    ({"advertise_host": "10.0.0.7", "replicas": [rep("http://10.0.0.7:20002")]}, "10.0.0.7", "reported port"),
    ({"advertise_host": "10.0.0.7", "replicas": [rep("file:///etc/passwd")]}, "10.0.0.7", "not an http"),
    ({"advertise_host": "10.0.0.7", "replicas": [rep("http://10.0.0.7:99999")]}, "10.0.0.7", "replicas[0].url"),
    ({"advertise_host": "10.0.0.7", "replicas": [rep("http://user@10.0.0.8:20001@10.0.0.7")]}, "10.0.0.7",
     "not an http"),
    ({"advertise_host": "10.0.0.7", "replicas": [rep("http://10.0.0.7:20001/../admin")]}, "10.0.0.7", "not an http"),
])
def test_a_replica_url_off_the_node_is_refused_naming_the_field(body, remote, wanted):
    problem = replica_url_problem(body, remote)
    assert problem and wanted in problem


@pytest.mark.parametrize("body,remote", [
    ({"advertise_host": "10.0.0.7", "replicas": [rep("http://10.0.0.7:20001")]}, "192.0.2.1"),
    ({"advertise_host": "GPU-7.example", "replicas": [rep("http://gpu-7.example:20001")]}, "192.0.2.1"),
    ({"advertise_host": "::1", "replicas": [rep("http://[::1]:20001")]}, "::1"),
    ({"replicas": [rep("http://127.0.0.1:20001")]}, "127.0.0.1"),
    ({"advertise_host": "10.0.0.7", "replicas": [rep(None, port=None)]}, "10.0.0.7"),   # not listening yet
])
def test_a_replica_url_on_the_node_is_fine(body, remote):
    assert replica_url_problem(body, remote) is None


def test_llmgwctl_token_node_prints_a_token_the_controller_takes(tmp_path):
    from click.testing import CliRunner

    from llmgwctl.cli import main
    (tmp_path / "agent.token").write_text(AGENT + "\n")
    os.chmod(tmp_path / "agent.token", 0o600)
    out = CliRunner().invoke(main, ["token", "node", "gpu-07", "--agent-token-file", str(tmp_path / "agent.token")])
    assert out.exit_code == 0, out.output
    token = out.output.strip()
    auth = ControlAuth(ADMIN, AGENT)
    assert auth.allowed("/api/v1/agents/gpu-07/report", f"Bearer {token}")
    assert auth.check("/api/v1/agents/gpu-08/report", f"Bearer {token}").status == 403
    bad = CliRunner().invoke(main, ["token", "node", "a b", "--agent-token-file", str(tmp_path / "agent.token")])
    assert bad.exit_code == 2 and "cannot be a node name" in bad.output
