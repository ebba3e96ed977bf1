"""A standalone router following the controller: it serves, reports usage, and drains like the in-process one."""
import threading

import pytest
import requests

from ..procs import free_port
from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: keep
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
GOING = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: going
    profiles: [{name: cpu, engine: fake, gpus: 0, args: [--tokens-per-second, "30"]}]
"""


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    (fleet.catalogs / "going.yaml").write_text(GOING)
    try:
        fleet.start_controller()
        fleet.start_agent("n1", "none")
        yield fleet
    finally:
        fleet.close()


def test_standalone_router_reports_usage_so_a_drain_waits_for_its_streams(fleet):
    port = free_port()
    router = fleet._spawn("router", ["router", "--listen", f"127.0.0.1:{port}", "--controller", fleet.control])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: fleet.ready("going") and fleet.ready("keep"), "replicas ready")
    wait_until(lambda: requests.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "going", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code == 200,
        "the standalone router serving")
    assert fleet.status()["routers"] == 1
    # Its requests reach the controller's request log (the console's) with its usage reports.
    assert requests.post(url + "/v1/chat/completions", timeout=10, headers={"X-Request-Id": "standalone-probe-1"},
                         json={"model": "going", "messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 1}).status_code == 200

    def logged():
        found = requests.get(fleet.control + "/api/v1/requests", params={"id": "standalone-probe-1"}, timeout=10)
        return found.json()["requests"]
    wait_until(logged, "the standalone router's request in the controller's request log")
    (entry,) = logged()
    assert entry["model"] == "going" and entry["status"] == 200 and entry["replica"] == fleet.ready("going")[0]["id"]
    result = {}

    def stream():
        # ~4 s: longer than the agent's 3 s stop grace, so only a real drain lets it finish.
        with requests.post(url + "/v1/chat/completions", stream=True, timeout=60, json={
                "model": "going", "stream": True, "max_tokens": 120, "ignore_eos": True,
                "messages": [{"role": "user", "content": "long"}]}) as resp:
            result["status"] = resp.status_code
            result["body"] = b"".join(resp.iter_content(None))

    (going,) = fleet.ready("going")
    thread = threading.Thread(target=stream)
    thread.start()
    # The controller learns of the stream from the router's usage report.
    wait_until(lambda: fleet.replicas("going")[0]["inflight"] == 1, "the stream in the controller's usage")
    # And in the autoscaler's load: the router's in-flight counter (request-seconds) grew by the
    # stream's seconds between two reports, and the controller averaged that over its passes.
    wait_until(lambda: next(m["autoscale"]["load"] or 0 for m in fleet.status()["models"] if m["name"] == "going") >= 0.5,
               "the stream's time-averaged concurrency in the model's load", timeout=30)
    (fleet.catalogs / "going.yaml").unlink()
    wait_until(lambda: fleet.replicas("going") and fleet.replicas("going")[0]["state"] == "draining", "draining")
    thread.join(60)
    assert result["status"] == 200 and result["body"].rstrip().endswith(b"data: [DONE]"), result
    wait_until(lambda: not fleet.replicas("going"), "the drained replica stopped")
    assert any(e["kind"] == "replica-stopping" and going["id"] in e["message"] and "drained" in e["message"]
               for e in fleet.status()["events"])
    assert requests.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "keep", "messages": [{"role": "user", "content": "x"}]}).status_code == 200
    router.terminate()
    router.wait(timeout=30)
