"""A node speaks only for what it was given, against a real `llmgwctl serve`, a real agent and a forged one.

The attacker holds one genuine node token -- `evil`'s, as any compromised GPU
machine does -- and posts reports by hand: a ready replica of a model that
serves elsewhere, with a spec computed by llmgw's own code from the catalog
(catalogs live in git) and a fake engine of its own behind it; pools and
GPUs the best profile wants; replica URLs on a cloud's metadata address;
values no machine has; a burst of changed big reports. Each is refused with
a 4xx or shown in status, the real replica keeps every request, /healthz and
chat answer through the burst, and a valid report after each is taken. Last,
the operator revokes `evil`'s token alone: refused within seconds, while the
real node's keeps working, and a new serial takes over.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from llmgwctl.catalog import load_dir
from llmgwctl.contracts import ReplicaSpec
from llmgwctl.control.auth import node_token
from tests.e2e.fleet import Fleet, wait_until, write_secret
from tests.router.harness import spawn_engine

ADMIN = "admin-" + "7d" * 16
AGENT = "agent-" + "8e" * 16
WAIT = 90.0         # a replica's start on a loaded 2-core machine, with room
NODE_TIMEOUT = "5"  # the forged agent reports between its attacks, not every 0.5 s like a real one

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: chat
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: big
    profiles:
      - {name: h100, engine: fake, gpus: 8, pool: h100, priority: 10}
      - {name: cpu, engine: fake, gpus: 0, pool: real, priority: 1}
"""


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def mint(fleet: Fleet, node: str, *options: str) -> str:
    """A node token as an operator mints one: `llmgwctl token node NODE ...`."""
    import subprocess

    out = subprocess.run([*fleet.command, "token", "node", node, "--agent-token-file", str(fleet.root / "agent.token"),
                          *options], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("node-trust")
    fleet = Fleet(root)
    fleet.admin_token = ADMIN
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    write_secret(root / "admin.token", ADMIN)
    write_secret(root / "agent.token", AGENT)
    (root / "revoked.txt").write_text("# NODE [SERIAL]: tokens of NODE below SERIAL are refused\n")
    write_secret(root / "real.token", mint(fleet, "real", "--pools", "real", "--max-gpus", "0"))
    engine = spawn_engine("chat", "attacker-engine")
    fleet.attacker_engine = engine
    try:
        fleet.start_controller("--token-file", str(root / "admin.token"), "--agent-token-file", str(root / "agent.token"),
                               "--node-revocations", str(root / "revoked.txt"), "--node-timeout", NODE_TIMEOUT)
        base = fleet._port_base
        fleet.agents["real"] = fleet._spawn("agent-real", [
            "agent", "--controller", fleet.control, "--node", "real", "--gpus", "none", "--pool", "real",
            "--state-dir", str(root / "state-real"), "--ports", f"{base}-{base + 9}", "--heartbeat", "0.5",
            "--grace", "3", "--token-file", str(root / "real.token")])
        wait_until(lambda: ready_on(fleet, "chat", "real") and ready_on(fleet, "big", "real"),
                   "chat and big ready on the real node", WAIT)
        yield fleet
    finally:
        engine.kill()
        fleet.close_waiting()


EVIL = node_token(AGENT, "evil")        # genuine, from before claims: what a compromised machine holds


def ready_on(fleet: Fleet, model: str, node: str) -> list[dict]:
    return [r for r in fleet.status()["replicas"] if r["model"] == model and r["node"] == node and r["state"] == "ready"]


def node_row(fleet: Fleet, name: str) -> dict | None:
    return next((n for n in fleet.status()["nodes"] if n["name"] == name), None)


def report(fleet: Fleet, body: dict | bytes, token: str = EVIL, node: str = "evil") -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(
        {"node": node, "gpus": [], "replicas": [], "pools": [], **body}).encode()
    return requests.post(f"{fleet.control}/api/v1/agents/{node}/report", data=data, timeout=30,
                         headers={**bearer(token), "Content-Type": "application/json"})


def valid_report_taken(fleet: Fleet, token: str = EVIL, what: str = "a valid report after the attack") -> None:
    """A plain report of the attacker's node is taken (waiting out a 429's Retry-After, bounded)."""
    def taken():
        resp = report(fleet, {"pools": [], "gpus": []}, token)
        if resp.status_code == 429:
            time.sleep(min(5.0, float(resp.headers["Retry-After"])))
            return False
        assert resp.status_code == 200, resp.text
        return True
    wait_until(taken, what, 60)


def forged_replica(fleet: Fleet, rid: str, model: str = "chat", profile: str = "cpu") -> dict:
    """A ready replica as an agent reports one, its spec computed from the catalog with llmgw's own code."""
    catalog = load_dir(fleet.catalogs)
    m = catalog.resolve(model)
    p = next(x for x in m.profiles if x.name == profile)
    spec = ReplicaSpec.for_profile(rid, m, p, catalog.engines[p.engine], ())
    url = fleet.attacker_engine.url
    port = int(url.rsplit(":", 1)[1])
    return {"id": rid, "spec_hash": spec.spec_hash, "model": spec.model, "profile": spec.profile,
            "engine": spec.engine, "gpu_indices": [], "port": port, "pid": 4242, "state": "ready",
            "restarts": 0, "url": url, "spec": spec.to_dict()}


class Repeating:
    """Post `body` as `evil` every 0.3 s in a thread, as a forged agent keeping its node alive would."""

    def __init__(self, fleet: Fleet, body: dict):
        self.fleet, self.body = fleet, body
        self.answers: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.answers.append(report(self.fleet, self.body).status_code)
            except requests.RequestException:
                pass
            self._stop.wait(0.3)

    def __enter__(self) -> Repeating:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def replica_of(resp: requests.Response) -> str:
    """Which replica answered: the fake engine's reply starts with `replica=ID`."""
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"].split()[0].removeprefix("replica=")


def served_by(fleet: Fleet, model: str, n: int = 20) -> list[str]:
    return [replica_of(fleet.chat(model, f"prompt {i}", max_tokens=2)) for i in range(n)]


# -- 2: an unplaced ready replica is not adopted ------------------------------------------------------

def test_an_unplaced_ready_replica_is_not_adopted_and_every_request_stays_on_the_real_one(fleet):
    (real,) = ready_on(fleet, "chat", "real")
    # A lower id than the real one, and ready at once: what won before.
    body = {"replicas": [forged_replica(fleet, "aaaa-attack")]}
    with Repeating(fleet, body) as attack:
        wait_until(lambda: 200 in attack.answers and node_row(fleet, "evil"), "the forged report taken")
        wait_until(lambda: any(e["kind"] == "replica-refused" and "aaaa-attack" in e["message"]
                               for e in fleet.status()["events"]), "the refusal in the events")
        assert served_by(fleet, "chat") == [real["id"]] * 20, "20 of 20 on the real replica"
        status = fleet.status()
    assert "aaaa-attack" not in {r["id"] for r in status["replicas"]}
    assert [r["id"] for r in status["replicas"] if r["model"] == "chat"] == [real["id"]]
    (said,) = [e["message"] for e in status["events"] if e["kind"] == "replica-refused" and "aaaa-attack" in e["message"]]
    assert "settling window is over" in said and "evil" in said
    valid_report_taken(fleet)


# -- 3: claims bounded by the operator --------------------------------------------------------------

def test_a_pool_and_gpus_beyond_the_token_are_refused_and_the_model_does_not_move(fleet):
    (real,) = ready_on(fleet, "big", "real")
    gpus = [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81920} for i in range(16)]
    body = {"pools": ["h100", "real"], "gpus": gpus, "engines": {"fake": {"available": True, "reason": ""}}}
    with Repeating(fleet, body) as attack:
        row = wait_until(lambda: (n := node_row(fleet, "evil")) and n["refused"] and n, "the refusal on evil's row")
        assert row["pools"] == [] and row["gpus"] == 8 and row["token"] == "legacy"
        said = " ".join(row["refused"])
        assert "pool 'h100'" in said and "pool 'real'" in said and "8 of 16 GPUs" in said
        assert any(e["kind"] == "node-claims-refused" for e in fleet.status()["events"])
        # Passes run with the claim in: big stays where it is, nothing is placed on evil.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status = fleet.status()
            assert not [r for r in status["replicas"] if r["node"] == "evil"], status["replicas"]
            time.sleep(0.5)
        assert served_by(fleet, "big") == [real["id"]] * 20
        assert 200 in attack.answers
    valid_report_taken(fleet)


# -- 4: replica URLs on the node's own address --------------------------------------------------------

@pytest.mark.parametrize("advertise, url", [
    ("", "http://169.254.169.254:80"),
    ("169.254.169.254", "http://169.254.169.254:80"),
    ("metadata.google.internal", "http://metadata.google.internal:80"),
    ("10.0.0.9", "http://10.0.0.9:80"),
], ids=["metadata-ip", "advertised-metadata-ip", "advertised-metadata-name", "advertised-other-host"])
def test_a_replica_url_off_the_reports_source_is_refused(fleet, advertise, url):
    rep = dict(forged_replica(fleet, "meta-1"), url=url, port=80)
    resp = report(fleet, {"advertise_host": advertise, "replicas": [rep]})
    assert resp.status_code == 400, resp.text
    assert "replicas[0].url" in resp.json()["error"]["message"]
    assert "meta-1" not in {r["id"] for r in fleet.status()["replicas"]}
    valid_report_taken(fleet)


def test_an_advertise_host_the_token_allows_is_honoured_but_never_a_metadata_address(fleet):
    allowed = mint(fleet, "evil", "--advertise-host", "localhost")
    rep = dict(forged_replica(fleet, "adv-1"), url="http://localhost:80", port=80)
    assert report(fleet, {"advertise_host": "localhost", "replicas": [rep]}, allowed).status_code == 200
    metadata = mint(fleet, "evil", "--advertise-host", "169.254.169.254")
    rep = dict(rep, url="http://169.254.169.254:80")
    resp = report(fleet, {"advertise_host": "169.254.169.254", "replicas": [rep]}, metadata)
    assert resp.status_code == 400 and "link-local" in resp.json()["error"]["message"], resp.text
    valid_report_taken(fleet)


# -- 5: values bounded ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    (b'{"node": "evil", "gpus": [{"index": 0, "memory_mib": 1e18}], "replicas": []}', "gpus[0].memory_mib"),
    (b'{"node": "evil", "gpus": [{"index": 0, "memory_mib": -80000}], "replicas": []}', "gpus[0].memory_mib"),
    (b'{"node": "evil", "gpus": [{"index": 0, "memory_mib": 1e400}], "replicas": []}', "gpus[0].memory_mib"),
    (b'{"node": "evil", "gpus": [{"index": 0, "memory_mib": NaN}], "replicas": []}', "gpus[0].memory_mib"),
    (b'{"node": "evil", "gpus": [{"index": 0, "memory_free_mib": 1e18}], "replicas": []}', "gpus[0].memory_free_mib"),
    (json.dumps({"node": "evil", "gpus": [{"index": i} for i in range(10_000)], "replicas": []}).encode(), "gpus"),
    (json.dumps({"node": "evil", "gpus": [], "pools": [f"p{i}" for i in range(10_000)], "replicas": []}).encode(), "pools"),
    (json.dumps({"node": "evil", "gpus": [{"index": 10_000}], "replicas": []}).encode(), "gpus[0].index"),
    (json.dumps({"node": "evil", "gpus": [], "replicas": [{"id": f"r{i}", "spec_hash": "", "model": "chat",
                                                           "state": "starting"} for i in range(10_000)]}).encode(),
     "replicas"),
], ids=["memory-1e18", "memory-negative", "memory-1e400", "memory-nan", "free-1e18", "10000-gpus", "10000-pools",
        "index-10000", "10000-replicas"])
def test_a_value_no_node_can_hold_is_a_400_naming_the_field(fleet, body, field):
    resp = report(fleet, body)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert field + ":" in message, message
    assert len(message) < 4000
    assert requests.get(fleet.control + "/healthz", timeout=10).ok
    valid_report_taken(fleet)


def test_a_burst_of_changed_big_reports_is_429d_while_healthz_and_chat_answer(fleet):
    (real,) = ready_on(fleet, "chat", "real")
    template = forged_replica(fleet, "x")
    # Changed reports of 2,000 replicas, the most a report may list: replica 0's restart count is
    # new in every post, so none is a heartbeat, and each would cost its parse and checks.
    reps = [dict(template, id=f"burst-{n}", restarts=77777777 if n == 0 else 0) for n in range(2_000)]
    base = json.dumps({"node": "evil", "gpus": [], "pools": [], "replicas": reps}).encode()
    codes: list[int] = []
    retry_after: list[str | None] = []
    stop = threading.Event()
    counter = iter(range(10**7))

    def post(k: int) -> None:
        session = requests.Session()
        while not stop.is_set():
            body = base.replace(b"77777777", b"%08d" % next(counter), 1)
            try:
                resp = session.post(f"{fleet.control}/api/v1/agents/evil/report", data=body,
                                    headers={**bearer(EVIL), "Content-Type": "application/json"}, timeout=60)
            except requests.RequestException:
                continue
            codes.append(resp.status_code)
            if resp.status_code == 429:
                retry_after.append(resp.headers.get("Retry-After"))

    threads = [threading.Thread(target=post, args=(k,), daemon=True) for k in range(12)]
    for t in threads:
        t.start()
    try:
        health, chats = [], []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline or len(codes) < 24:
            health.append(requests.get(fleet.control + "/healthz", timeout=30).status_code)
            chat = fleet.chat("chat", "during the burst", max_tokens=2)
            chats.append((chat.status_code, replica_of(chat)))
            if time.monotonic() > deadline + 60:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=90)
    assert codes.count(429) > codes.count(200) + codes.count(400), f"{len(codes)} answers: mostly 429s"
    assert retry_after and all(r is not None and int(r) >= 1 for r in retry_after)
    assert set(health) == {200}
    assert set(chats) == {(200, real["id"])}
    assert not {r["id"] for r in fleet.status()["replicas"]} & {f"burst-{n}" for n in range(10)}
    valid_report_taken(fleet, what="a valid report once the bucket refilled")


# -- per-node revocation ------------------------------------------------------------------------------------

def test_a_revoked_node_token_is_refused_within_seconds_while_another_nodes_keeps_working(fleet):
    (real,) = ready_on(fleet, "chat", "real")
    valid_report_taken(fleet)
    revoked = fleet.root / "revoked.txt"
    revoked.write_text(revoked.read_text() + "evil\n")
    refusal = wait_until(lambda: (r := report(fleet, {})).status_code == 401 and r.json(), "evil's token refused", 30)
    assert "revoked" in refusal["error"]["message"]
    wait_until(lambda: node_row(fleet, "evil")["state"] == "unreachable", "evil lost at once", 30)
    assert any(e["kind"] == "node-revoked" for e in fleet.status()["events"])
    # The real node's token is untouched: its reports go on being taken, its replica serves.
    before = node_row(fleet, "real")["reports"]
    wait_until(lambda: node_row(fleet, "real")["reports"] >= before + 3, "the real node's reports taken")
    assert served_by(fleet, "chat", 5) == [real["id"]] * 5

    # A new token for evil, with the next serial, once the list says serials below 1 are refused.
    new = mint(fleet, "evil", "--serial", "1")
    assert report(fleet, {}, new).status_code == 401, "every token of evil is revoked still"
    revoked.write_text("evil 1\n")
    wait_until(lambda: report(fleet, {}, new).status_code != 401, "the new serial's token taken", 30)
    valid_report_taken(fleet, new, "the new serial's report")
    old = report(fleet, {})
    assert old.status_code == 401 and "serial 0" in old.json()["error"]["message"]
