"""Anthropic's Messages API through the router: the official `anthropic` SDK, a real router, real fake engines.

The SDK is the judge of the wire: it parses the answers, the stream's
events and the errors (raising its own exception classes by status and
reading `{"type": "error", "error": {...}}`), and it sends its key in
`x-api-key`, so keys are on for the whole module. The fake engine serves
/v1/messages as vLLM does (fake_messages.py) and 404s any model name but
its own, so an answer by alias shows that the engine got the canonical name.
"""
from __future__ import annotations

import logging
import threading

import anthropic
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from llmgwctl.router.auth import hash_key, parse_keys

from .harness import catalog, make_router, wait_until

MODEL = "org/msg-model"
ALIAS = "claude-local"
SECRET = "sk-msg-" + "m" * 40
NARROW = "sk-msg-narrow-" + "n" * 32        # a key for another model only
KEYS = parse_keys({"keys": [
    {"name": "team", "sha256": hash_key(SECRET), "models": ["*"], "rpm": 100_000},
    {"name": "narrow", "sha256": hash_key(NARROW), "models": ["other-*"], "rpm": 100_000}]})
HELLO = [{"role": "user", "content": "hello there"}]


class NoWaker:
    """A control plane that is asked to start the model and never does."""

    def wake(self, model_name: str) -> None:
        pass


@pytest.fixture
def served(engines, routers):
    engine = engines(MODEL, "m1")
    rt = routers(make_router(catalog((MODEL, (ALIAS,)), ("other-model", ()))))
    rt.set_endpoints([engine.endpoint()])
    rt.call(rt.router.set_api_keys, KEYS)
    return engine, rt


def client(rt, key: str = SECRET) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=rt.url, api_key=key, max_retries=0, timeout=30)


def test_messages_create_answers_with_text_and_usage_under_the_name_asked(served):
    engine, rt = served
    for name in (MODEL, ALIAS):
        raw = client(rt).messages.with_raw_response.create(model=name, max_tokens=8, messages=HELLO,
                                                           system="Be brief.")
        msg = raw.parse()
        assert msg.model == name and msg.role == "assistant" and msg.stop_reason == "max_tokens"
        (block,) = msg.content
        assert block.type == "text" and "replica=m1" in block.text and f"model={MODEL}" in block.text
        assert msg.usage.output_tokens == 8 and msg.usage.input_tokens == 4    # "Be brief." + "hello there"
        assert raw.headers["x-llmgw-replica"] == "m1" and raw.headers["X-Request-Id"]


def test_a_stream_has_the_sdks_events_and_names_the_alias(served):
    engine, rt = served
    with client(rt).messages.stream(model=ALIAS, max_tokens=6, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.startswith("replica=m1") and final.model == ALIAS
    assert final.usage.output_tokens == 6 and final.usage.input_tokens == 2 and final.stop_reason == "max_tokens"
    events = list(client(rt).messages.create(model=ALIAS, max_tokens=3, messages=HELLO, stream=True))
    kinds = [e.type for e in events]
    # The SDK yields every event but `ping`, which it skips.
    kinds.insert(2, "ping")
    assert kinds == ["message_start", "content_block_start", "ping", *["content_block_delta"] * 3,
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.model == ALIAS
    # Through the router the stream is the engine's, the name aside.
    body = {"model": MODEL, "max_tokens": 3, "messages": HELLO, "stream": True}
    headers = {"x-api-key": SECRET, "anthropic-version": "2023-06-01"}
    via = requests.post(rt.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert via.headers["Content-Type"].startswith("text/event-stream")
    assert [line for line in via.text.splitlines() if line.startswith("event: ")] == [f"event: {k}" for k in kinds]


def test_count_tokens_is_routed_by_model_and_agrees_with_the_usage_of_create(served):
    engine, rt = served
    c = client(rt)
    system = "You answer questions about the weather."
    counted = c.messages.count_tokens(model=ALIAS, system=system, messages=HELLO)
    made = c.messages.create(model=ALIAS, max_tokens=2, system=system, messages=HELLO)
    assert counted.input_tokens == made.usage.input_tokens == 8


def test_an_unknown_model_is_the_sdks_not_found_error(served):
    engine, rt = served
    with pytest.raises(anthropic.NotFoundError) as raised:
        client(rt).messages.create(model="claude-locall", max_tokens=4, messages=HELLO)
    err = raised.value
    assert err.status_code == 404 and err.body["type"] == "error"
    assert err.body["error"]["type"] == "not_found_error"
    assert "does not exist" in err.body["error"]["message"] and repr(ALIAS) in err.body["error"]["message"]
    assert err.response.headers["X-Request-Id"]
    with pytest.raises(anthropic.NotFoundError):
        client(rt).messages.count_tokens(model="nope", messages=HELLO)


def test_keys_are_read_from_x_api_key_with_every_rule_as_for_a_bearer(served):
    engine, rt = served
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client(rt, "sk-wrong").messages.create(model=ALIAS, max_tokens=4, messages=HELLO)
    assert raised.value.status_code == 401 and raised.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in raised.value.body["error"]["message"]
    # A key limited to other models: the same 403 whether the model exists or not.
    for name in (ALIAS, "no-such-model"):
        with pytest.raises(anthropic.PermissionDeniedError) as raised:
            client(rt, NARROW).messages.create(model=name, max_tokens=4, messages=HELLO)
        assert raised.value.body["error"]["type"] == "permission_error"
    # An Authorization header is the request's credential: a bad bearer is not saved by a good x-api-key.
    answer = requests.post(rt.url + "/v1/messages", json={"model": ALIAS, "max_tokens": 2, "messages": HELLO},
                           headers={"x-api-key": SECRET, "Authorization": "Bearer sk-wrong"}, timeout=30)
    assert answer.status_code == 401
    # The key in x-api-key works on the OpenAI routes too, and is never passed on to the engine.
    chat = requests.post(rt.url + "/v1/chat/completions", headers={"x-api-key": SECRET}, timeout=30,
                         json={"model": ALIAS, "messages": HELLO, "max_tokens": 2})
    assert chat.status_code == 200
    listed = requests.get(rt.url + "/v1/models", headers={"x-api-key": SECRET}, timeout=30)
    assert listed.status_code == 200 and ALIAS in {m["id"] for m in listed.json()["data"]}


def test_the_router_s_own_errors_on_messages_are_anthropic_shaped_and_openai_s_stay_openai(served):
    engine, rt = served
    headers = {"x-api-key": SECRET}
    for body, status, kind in [(b"{not json", 400, "invalid_request_error"),
                               (b'{"messages": []}', 400, "invalid_request_error")]:
        answer = requests.post(rt.url + "/v1/messages", data=body, headers=headers, timeout=30)
        assert answer.status_code == status and answer.headers["X-Request-Id"]
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == kind
    wrong = requests.get(rt.url + "/v1/messages", headers=headers, timeout=30)
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"
    assert wrong.json()["error"]["type"] == "invalid_request_error"
    assert wrong.headers["Allow"].startswith("POST")
    # The engine's own errors pass through as it gave them (vLLM's are Anthropic-shaped on this route).
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(rt).messages.create(model=ALIAS, max_tokens=4, messages=[])
    assert raised.value.body["error"]["type"] == "BadRequestError"
    chat = requests.post(rt.url + "/v1/chat/completions", data=b"{not json", headers=headers, timeout=30)
    assert chat.status_code == 400 and set(chat.json()) == {"error"}


def test_messages_usage_is_metered_as_chat_tokens_are(served):
    engine, rt = served
    c = client(rt)
    c.messages.create(model=ALIAS, max_tokens=4, messages=HELLO)
    with c.messages.stream(model=ALIAS, max_tokens=3, messages=HELLO) as stream:
        stream.get_final_message()
    c.messages.count_tokens(model=ALIAS, messages=HELLO)       # a count spends no tokens

    def tokens() -> dict[tuple[str, str], float]:
        page = requests.get(rt.url + "/metrics", headers={"x-api-key": SECRET}, timeout=10).text
        found = {}
        for family in text_string_to_metric_families(page):
            for s in family.samples:
                if s.name in ("llmgw_router_tokens_total", "llmgw_router_key_tokens_total"):
                    found[(s.name, s.labels["direction"])] = s.value
        return found

    assert tokens() == {("llmgw_router_tokens_total", "in"): 4, ("llmgw_router_tokens_total", "out"): 7,
                        ("llmgw_router_key_tokens_total", "in"): 4, ("llmgw_router_key_tokens_total", "out"): 7}


def test_a_stream_whose_engine_dies_ends_with_an_error_event_the_sdk_raises(engines, routers):
    engine = engines(MODEL, "dies", "--tokens-per-second", "20")
    rt = routers(make_router(catalog((MODEL, (ALIAS,)))))
    rt.set_endpoints([engine.endpoint()])
    c = anthropic.Anthropic(base_url=rt.url, api_key="unused", max_retries=0, timeout=30)
    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        for event in c.messages.create(model=ALIAS, max_tokens=40, messages=HELLO, stream=True):
            seen.append(event.type)
            if seen.count("content_block_delta") == 2:
                engine.kill()
    assert seen[0] == "message_start" and "message_stop" not in seen
    assert raised.value.body["error"]["type"] == "api_error"
    assert "stopped mid-stream" in raised.value.body["error"]["message"]


def test_a_stream_held_for_a_cold_start_ends_with_an_anthropic_error_event(engines, routers):
    # No endpoint ever joins: the stream opens (comments keep it company), then the cold timeout ends it.
    rt = routers(make_router(catalog((MODEL, (ALIAS,))), waker=NoWaker(), cold_timeout=2.0, cold_keepalive=0.5))
    c = anthropic.Anthropic(base_url=rt.url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(anthropic.APIStatusError) as raised:
        list(c.messages.create(model=ALIAS, max_tokens=4, messages=HELLO, stream=True))
    assert raised.value.body["error"]["type"] == "overloaded_error"
    assert "no replica was ready" in raised.value.body["error"]["message"]


# -- the name asked, echoed on the OpenAI routes too ------------------------------------------

def test_openai_answers_name_the_alias_asked_whole_and_in_every_chunk(served, caplog):
    engine, rt = served
    c = openai.OpenAI(base_url=rt.url + "/v1", api_key=SECRET, max_retries=0, timeout=30)
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        chat = c.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=4)
        assert chat.model == ALIAS and f"model={MODEL}" in chat.choices[0].message.content
        chunks = list(c.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True}))
        assert len(chunks) == 7 and {ch.model for ch in chunks} == {ALIAS}
        assert chunks[-1].usage.completion_tokens == 5
        done = c.completions.create(model=ALIAS, prompt="once", max_tokens=3)
        assert done.model == ALIAS
        assert {ch.model for ch in c.completions.create(model=ALIAS, prompt="x", max_tokens=3, stream=True)} == {ALIAS}
        assert c.embeddings.create(model=ALIAS, input=["a"]).model == ALIAS
        # By its own name, the model's own name comes back.
        assert c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).model == MODEL
        client(rt).messages.create(model=ALIAS, max_tokens=2, messages=HELLO)
        wait_until(lambda: len([r for r in caplog.records if r.name == "llmgw.access"]) >= 7, timeout=10,
                   what="the access lines")
    lines = [r for r in caplog.records if r.name == "llmgw.access"]
    aliased = [r for r in lines if r.model_asked == ALIAS]
    assert len(aliased) == 6 and all(r.model == MODEL for r in aliased)
    assert all(f"model={MODEL} asked={ALIAS} endpoint=m1" in r.getMessage() for r in aliased)
    (direct,) = [r for r in lines if r.model_asked == MODEL]
    assert " asked=" not in direct.getMessage()


def test_streams_of_many_clients_by_alias_each_keep_their_events_whole(served):
    # Several streams at once, each read by its own client: every event parses and names the alias.
    engine, rt = served
    failures: list[BaseException] = []

    def one() -> None:
        try:
            with client(rt).messages.stream(model=ALIAS, max_tokens=10, messages=HELLO) as stream:
                assert len(list(stream.text_stream)) == 10
                assert stream.get_final_message().model == ALIAS
        except BaseException as exc:  # noqa: BLE001 -- handed to the test, whose assertion shows it
            failures.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures and not any(t.is_alive() for t in threads)


def test_messages_sharing_a_system_prompt_stick_to_one_replica_with_chat_sharing_it_too(engines, routers):
    # Two replicas and the default (prefix) policy: the prompt is read from `system` + `messages`.
    a, b = engines(MODEL, "pa"), engines(MODEL, "pb")
    rt = routers(make_router(catalog((MODEL, (ALIAS,)))))
    rt.set_endpoints([a.endpoint(), b.endpoint()])
    c = anthropic.Anthropic(base_url=rt.url, api_key="unused", max_retries=0, timeout=30)
    system = "You answer questions about the llmgw gateway, briefly and precisely. " * 40
    first = c.messages.with_raw_response.create(model=ALIAS, max_tokens=1, system=system, messages=HELLO)
    home = first.headers["x-llmgw-replica"]
    picked = {c.messages.with_raw_response.create(
        model=ALIAS, max_tokens=1, system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": f"question {i}"}]).headers["x-llmgw-replica"] for i in range(6)}
    chat = requests.post(rt.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "system", "content": system},
                                                      {"role": "user", "content": "and chat?"}]})
    assert picked == {home} and chat.headers["x-llmgw-replica"] == home
