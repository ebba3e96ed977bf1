"""Fail fast with the reason (issue 15): a model the controller says cannot be placed is answered at once.

A real router on loopback, told model states as the controller tells them;
no engine is needed, since such a model has no endpoint by definition.
"""
from __future__ import annotations

import threading

import pytest
import requests

from llmgwctl.contracts import ModelCondition, ModelState

from .harness import RouterThread, catalog, make_router


class Waker:
    def __init__(self) -> None:
        self.woken = threading.Event()

    def wake(self, model_name: str) -> None:
        self.woken.set()


@pytest.fixture
def router():
    waker = Waker()
    rt = RouterThread(make_router(catalog(("big", ()), ("busy", ()), ("coming", ())), waker=waker, cold_timeout=60))
    rt.waker = waker
    try:
        yield rt
    finally:
        rt.close()


def chat(rt, model, timeout=30):
    return requests.post(rt.url + "/v1/chat/completions", timeout=timeout,
                         json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


def test_unplaceable_for_good_is_a_503_with_the_reason_and_no_retry(router):
    router.call(router.router.set_model_states, [
        ModelState("big", ModelCondition.UNPLACEABLE, "the largest node has 4 GPUs, needs 8", retry=False)])
    resp = chat(router, "big")
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert err["code"] == "model_unplaceable" and "the largest node has 4 GPUs, needs 8" in err["message"]
    assert "Retry-After" not in resp.headers and resp.headers["x-should-retry"] == "false"


def test_unplaceable_for_now_is_a_503_with_retry_after(router):
    router.call(router.router.set_model_states, [ModelState("busy", ModelCondition.UNPLACEABLE, "no room", retry=True)])
    resp = chat(router, "busy")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_unplaceable"
    assert int(resp.headers["Retry-After"]) > 0 and "x-should-retry" not in resp.headers


def test_a_waiting_request_is_answered_once_its_model_turns_out_unplaceable(router):
    router.call(router.router.set_model_states, [ModelState("coming", ModelCondition.STARTING)])
    result = {}
    t = threading.Thread(target=lambda: result.update(resp=chat(router, "coming")))
    t.start()
    assert router.waker.woken.wait(10)
    # The request is held (starting: it waits, as with no state at all) until
    # the controller says nothing can come; then it is answered, not at the
    # cold timeout of 60 s (the client's 30 s timeout would fail first).
    router.call(router.router.set_model_states, [ModelState("coming", ModelCondition.UNPLACEABLE, "no room")])
    t.join(30)
    assert result["resp"].status_code == 503 and result["resp"].json()["error"]["code"] == "model_unplaceable"


def test_a_model_placeable_again_waits_instead(router):
    router.call(router.router.set_model_states, [ModelState("big", ModelCondition.UNPLACEABLE, "x", retry=False)])
    assert chat(router, "big").status_code == 503
    router.call(router.router.set_model_states, [])
    # With nothing said, a request waits for a replica (the cold start): its
    # short timeout runs out while it is held.
    with pytest.raises(requests.ReadTimeout):
        chat(router, "big", timeout=1)
