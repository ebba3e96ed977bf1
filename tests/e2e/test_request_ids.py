"""A real `llmgwctl serve` (JSON logs, a fake engine scaled from zero): one request id at client, router log and engine.

The model starts cold, so the first request is a stream held for a cold start
with keep-alive comments, read through the official `openai` SDK; the next one
carries a trace context. Then the id each client saw is found in the router's
access line (with the replica, status and tokens) and in the engine's own log.
"""
from __future__ import annotations

import json

import openai
import requests

from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: rid-chat
    replicas: {min: 0, max: 1}
    idle_timeout: 10m
    profiles:
      - {name: cpu, engine: fake, gpus: 0, args: [--log-requests, --startup-delay, "1.5"]}
"""
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_one_id_at_client_router_log_and_engine_through_a_cold_start(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "0", "--log-format", "json", "--cold-keepalive", "0.3")
        wait_until(lambda: requests.get(fleet.router + "/readyz", timeout=2).status_code == 200, "router ready")
        assert requests.get(fleet.router + "/health", timeout=5).json() == {"status": "ok"}
        assert fleet.ready("rid-chat") == []        # cold: scaled to zero
        client = openai.OpenAI(base_url=fleet.router + "/v1", api_key="unused", max_retries=0, timeout=90)
        raw = client.chat.completions.with_raw_response.create(
            model="rid-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True,
            extra_headers={"X-Request-Id": "e2e-cold-1"})
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        assert text and raw.headers["x-request-id"] == "e2e-cold-1"
        # It was held for the cold start (the engine takes 1.5 s to load: several comments' worth).
        metrics = requests.get(fleet.router + "/metrics", timeout=10).text
        assert 'llmgw_router_cold_wait_seconds_count{model="rid-chat",outcome="served"} 1.0' in metrics
        r = requests.post(
            fleet.router + "/v1/chat/completions", timeout=30,
            headers={"X-Request-Id": "e2e-plain-1", "traceparent": TRACEPARENT, "Authorization": "Bearer x"},
            json={"model": "rid-chat", "messages": [{"role": "user", "content": "again"}], "max_tokens": 3})
        assert r.status_code == 200 and r.headers["X-Request-Id"] == "e2e-plain-1"
        replica = r.headers["x-llmgw-replica"]

        def access():
            docs = [json.loads(line) for line in fleet.log("serve").splitlines() if line.strip()]
            got = {d["request_id"]: d for d in docs if d.get("event") == "access"}
            return (docs, got) if {"e2e-cold-1", "e2e-plain-1"} <= got.keys() else None
        docs, lines = wait_until(access, "both access lines")   # json.loads of every line: all of them are JSON
        plain = lines["e2e-plain-1"]
        usage = r.json()["usage"]
        assert plain["status"] == 200 and plain["endpoint"] == replica and plain["model"] == "rid-chat"
        assert (plain["tokens_in"], plain["tokens_out"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert lines["e2e-cold-1"]["status"] == 200 and lines["e2e-cold-1"]["endpoint"] == replica

        def engine_lines():
            found = [line for path in (tmp_path / "state-serve").rglob("*.log")
                     for line in path.read_text(errors="replace").splitlines() if line.startswith("fake engine")]
            return found if len(found) >= 2 else None
        seen = engine_lines() or wait_until(engine_lines, "the engine's request lines")
        assert any("x-request-id=e2e-cold-1" in line for line in seen)
        (traced,) = [line for line in seen if "x-request-id=e2e-plain-1" in line]
        assert f"traceparent={TRACEPARENT}" in traced and "authorization=absent" in traced
    finally:
        fleet.close()
