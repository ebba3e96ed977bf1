"""Fallback models end to end: `llmgwctl serve` with its local agent, fake engines, API keys, a live edit.

`big` asks for more GPUs than the machine has, so the controller cannot place
it; its requests are answered by `small`, its fallback, and say so. A key
limited to `big` does not reach `small` through it. Once an edit makes `big`
placeable and its replica is ready, it answers itself again.
"""
from __future__ import annotations

import json
import subprocess
import sys

import requests

from llmgwctl.router.auth import hash_key

from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: big
    aliases: [best]
    fallbacks: [small]
    profiles: [{name: gpu, engine: fake, gpus: 8}]
  - name: small
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
KEY_BIG, KEY_ALL = "sk-only-big-" + "a" * 32, "sk-every-model-" + "b" * 32


def chat(fleet: Fleet, model: str, key: str, rid: str, **extra) -> requests.Response:
    return requests.post(fleet.router + "/v1/chat/completions", timeout=30,
                         headers={"Authorization": f"Bearer {key}", "X-Request-Id": rid},
                         json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                               **extra})


def access_lines(fleet: Fleet) -> dict[str, dict]:
    docs = [json.loads(line) for line in fleet.log("serve").splitlines() if line.startswith("{")]
    return {d["request_id"]: d for d in docs if d.get("event") == "access"}


def test_an_unplaceable_model_is_served_by_its_fallback_within_its_keys_and_by_itself_once_placed(tmp_path):
    fleet = Fleet(tmp_path)
    models = fleet.catalogs / "models.yaml"
    models.write_text(CATALOG)
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n"
                    f"  - {{name: only-big, sha256: {hash_key(KEY_BIG)}, models: [big], rpm: 1000}}\n"
                    f"  - {{name: every, sha256: {hash_key(KEY_ALL)}, models: ['*'], rpm: 1000}}\n")
    try:
        fleet.start_serve("--settle", "0", "--log-format", "json", "--api-keys", str(keys))
        wait_until(lambda: fleet.ready("small"), "small ready")
        wait_until(lambda: next(m for m in fleet.status()["models"] if m["name"] == "big")["unplaceable"],
                   "big unplaceable")

        # Asked for by an alias, answered by small under its own name, and the answer says so.
        resp = chat(fleet, "best", KEY_ALL, "fb-1")
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "small"
        assert resp.headers["x-llmgw-model"] == "small" and resp.headers["x-llmgw-fallback-from"] == "big"
        with chat(fleet, "big", KEY_ALL, "fb-stream", stream=True) as streamed:
            assert streamed.status_code == 200 and streamed.headers["x-llmgw-fallback-from"] == "big"
            assert b"data: [DONE]" in streamed.content

        # A key limited to big: big's own refusal, the placement's reason; small is not reached.
        resp = chat(fleet, "big", KEY_BIG, "fb-narrow")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_unplaceable", resp.text
        assert "x-llmgw-model" not in resp.headers and "x-llmgw-fallback-from" not in resp.headers
        assert chat(fleet, "small", KEY_BIG, "fb-forbidden").status_code == 403

        lines = wait_until(lambda: (got := access_lines(fleet)).keys() >= {"fb-1", "fb-narrow"} and got,
                           "the access lines")
        assert lines["fb-1"]["model"] == "small" and lines["fb-1"]["fallback_from"] == "big"
        assert lines["fb-narrow"]["status"] == 503 and "fallback_from" not in lines["fb-narrow"]
        metrics = requests.get(fleet.router + "/metrics", headers={"Authorization": f"Bearer {KEY_ALL}"},
                               timeout=10).text
        assert 'llmgw_router_fallbacks_total{fallback="small",model="big",reason="unplaceable"} 2.0' in metrics

        # `llmgwctl status` shows the chain, with what is ready in it.
        out = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", fleet.control],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "big falls back to small (1 ready)" in out.stdout
        assert next(m for m in fleet.status()["models"] if m["name"] == "big")["fallbacks"] == ["small"]

        # An edit that makes big placeable: once its replica is ready, big answers itself.
        models.write_text(CATALOG.replace("gpus: 8", "gpus: 0"))
        wait_until(lambda: fleet.ready("big"), "big ready after the edit")
        resp = wait_until(lambda: (r := chat(fleet, "big", KEY_BIG, "fb-back")).headers.get("x-llmgw-model") == "big"
                          and r, "big answering itself")
        assert resp.status_code == 200 and resp.json()["model"] == "big"
        assert "x-llmgw-fallback-from" not in resp.headers
    finally:
        fleet.close()


def test_a_live_edit_that_makes_a_cycle_is_rejected_and_the_chain_in_force_stays(tmp_path):
    fleet = Fleet(tmp_path)
    models = fleet.catalogs / "models.yaml"
    models.write_text(CATALOG.replace("gpus: 8", "gpus: 0"))
    try:
        fleet.start_serve("--settle", "0")
        version = wait_until(lambda: fleet.status()["catalog"]["version"], "the catalog in force")
        models.write_text(CATALOG.replace("    profiles: [{name: cpu", "    fallbacks: [best]\n    profiles: [{name: cpu"))
        rejection = wait_until(lambda: fleet.status()["catalog"]["last_rejection"], "the edit rejected")
        assert any(f"{models}:9:17: models[1].fallbacks[0]: 'best' makes a cycle of fallbacks: big -> small -> big"
                   in e for e in rejection["errors"]), rejection
        status = fleet.status()
        assert status["catalog"]["version"] == version
        assert next(m for m in status["models"] if m["name"] == "big")["fallbacks"] == ["small"]
    finally:
        fleet.close()
