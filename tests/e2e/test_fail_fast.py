"""Fail fast with the reason (issue 15), with a controller, agents on simulated GPUs and fake engines.

A model no node can ever hold, or one waiting for room nobody frees, used to
hold every request for the whole cold-start timeout (120 s) and then say it
"is starting"; the OpenAI SDK's two retries tripled that. Now the controller
tells the router (in-process, and a standalone router over the watch stream)
which models cannot be placed and why, and such a request is answered at
once: 503, code `model_unplaceable`, the placement's reason, `Retry-After`
only when the situation can change by itself. A model that is starting still
waits, and one that becomes placeable (a node joins) stops failing.

Every request below has a 30 s client timeout, well inside the 120 s cold
timeout: on the old code each fail-fast request times out instead.
"""
from __future__ import annotations

import re

import openai
import pytest
import requests

from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: huge
    profiles: [{name: eight, engine: fake, gpus: 8}]
  - name: nopool
    profiles: [{name: h100, engine: fake, gpus: 1, pool: h100}]
  - name: blocker
    profiles: [{name: four, engine: fake, gpus: 4}]
  - name: crowded
    profiles: [{name: four, engine: fake, gpus: 4}]
  - name: lazy
    replicas: {min: 0, max: 1}
    idle_timeout: 10m
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path / "fleet")
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_controller()
        fleet.start_agent("n1", "4xL4-24GB")
        fleet.start_agent("n2", "2xL4-24GB")
        wait_until(lambda: fleet.ready("blocker"), "blocker ready on n1")
        yield fleet
    finally:
        fleet.close()


def chat(base: str, model: str) -> requests.Response:
    return requests.post(base + "/v1/chat/completions", timeout=30,
                         json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


def unrouted_503(base: str, model: str) -> int:
    text = requests.get(base + "/metrics", timeout=5).text
    found = re.search(r'llmgw_router_requests_total\{code="503",endpoint="",model="%s"\} ([\d.]+)' % model, text)
    return int(float(found.group(1))) if found else 0


def check_fail_fast(base: str) -> None:
    for model, words in (("huge", "needs 8"), ("nopool", "h100")):
        resp = chat(base, model)
        assert resp.status_code == 503, (model, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert err["code"] == "model_unplaceable" and words in err["message"], err
        # Nothing will change this by itself: no Retry-After, and SDKs told not to retry.
        assert "Retry-After" not in resp.headers and resp.headers.get("x-should-retry") == "false"
    # blocker holds n1's four GPUs and n2 has two: no room now, but there may be later.
    resp = chat(base, "crowded")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_unplaceable", resp.text
    assert int(resp.headers["Retry-After"]) > 0


def test_unplaceable_models_are_answered_at_once_starting_ones_are_waited_for(fleet):
    wait_until(lambda: {m["name"] for m in fleet.status()["models"] if m["unplaceable"]} >= {"huge", "nopool", "crowded"},
               "placement to give up on huge, nopool and crowded")
    check_fail_fast(fleet.router)
    # The same through a standalone router, told over the watch stream.
    standalone = fleet.start_router()
    wait_until(lambda: chat(standalone, "huge").status_code == 503, "the standalone router to hear of huge")
    check_fail_fast(standalone)

    # The OpenAI SDK with its default retries gets the error from one attempt.
    before = unrouted_503(fleet.router, "huge")
    assert before >= 1      # the requests above were counted: the count below means something
    client = openai.OpenAI(base_url=fleet.router + "/v1", api_key="none", timeout=30)
    assert client.max_retries == 2
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="huge", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 503 and "needs 8" in str(caught.value)
    assert unrouted_503(fleet.router, "huge") == before + 1, "the SDK retried a 503 that cannot change"

    # A model that can start is waited for, and answered once it is up.
    assert chat(fleet.router, "lazy").status_code == 200

    # A node that can hold huge joins: it stops failing and its request waits for the start.
    fleet.start_agent("n3", "8xL4-24GB")
    wait_until(lambda: not next(m for m in fleet.status()["models"] if m["name"] == "huge")["unplaceable"],
               "huge placed on n3")
    assert chat(fleet.router, "huge").status_code == 200
    assert chat(standalone, "huge").status_code == 200
