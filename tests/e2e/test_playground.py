"""The console's playground relay (control.playground) against a real `llmgwctl serve` with API keys and a token.

The prompt goes to the router as any client's: without a key the router's
401 comes back (the admin token the relay was called with is not a key), a
key's models bound it (403), and with a key it streams, under the request
id the page chose, which the request log then holds with the key's name.
Bad bodies are the relay's own 400s; the relay needs the admin token like
the rest of the control API.
"""
from __future__ import annotations

import hashlib
import json

import requests

from .fleet import Fleet, wait_until, write_secret

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: open-one
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: closed-one
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
KEY = "k3y-" + "z" * 40
TOKEN = "t0ken-" + "x" * 30


def test_the_playground_relays_through_the_router_under_its_key_rules(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - name: team-play\n    sha256: " + hashlib.sha256(KEY.encode()).hexdigest()
                    + "\n    models: [open-one]\n    rpm: 600\n")
    token = write_secret(tmp_path / "token", TOKEN)
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "m.yaml").write_text(CATALOG)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    url = None
    try:
        fleet.start_serve("--settle", "1", "--api-keys", str(keys), "--token-file", str(token))
        url = fleet.control + "/api/v1/playground/chat"
        wait_until(lambda: requests.get(fleet.control + "/api/v1/status", headers=admin, timeout=5).json()["models"][0]
                   ["ready"] == 1, "open-one ready", timeout=60)

        def send(body, key=None, headers=admin):
            extra = {"X-Llmgw-Api-Key": key} if key else {}
            return requests.post(url, json=body, headers={**headers, **extra}, timeout=60)
        prompt = {"model": "open-one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert send(prompt, KEY, headers={}).status_code == 401, "the relay needs the admin token"
        no_key = send(prompt)
        assert no_key.status_code == 401 and "key" in no_key.json()["error"]["message"].lower()
        assert send(prompt | {"model": "closed-one"}, KEY).status_code == 403
        for bad in ({"model": "open-one"}, {"model": "", "messages": []}, prompt | {"max_tokens": 10**6}, [1]):
            resp = send(bad, KEY)
            assert resp.status_code == 400 and resp.json()["error"]["message"], bad

        resp = requests.post(url, json=prompt, headers={**admin, "X-Llmgw-Api-Key": KEY,
                                                        "X-Request-Id": "play-ground-1"}, timeout=60)
        assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Request-Id"] == "play-ground-1" and resp.headers["x-llmgw-replica"]
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert chunks[-1]["usage"]["completion_tokens"] > 0
        (logged,) = requests.get(fleet.control + "/api/v1/requests", params={"id": "play-ground-1"}, headers=admin,
                                 timeout=10).json()["requests"]
        assert logged["key"] == "team-play" and logged["model"] == "open-one" and logged["status"] == 200
        refused = requests.get(fleet.control + "/api/v1/requests", params={"status": "4xx"}, headers=admin,
                               timeout=10).json()["requests"]
        assert {r["status"] for r in refused} == {401, 403} and all(r["error"] for r in refused)
    finally:
        fleet.close()
