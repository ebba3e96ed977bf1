"""The fake engine's Anthropic Messages routes, spoken to with the official `anthropic` SDK as vLLM's are."""
from __future__ import annotations

import anthropic
import pytest
import requests

MODEL = "fake-claude"
HELLO = [{"role": "user", "content": "what is two plus two"}]


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=30)


def test_messages_answer_as_the_chat_route_does_in_anthropics_shape(fake_engine):
    engine = fake_engine(MODEL, "--replica-id", "a1")
    c = client(engine.url)
    msg = c.messages.create(model=MODEL, max_tokens=5, system="Be brief.", messages=HELLO)
    assert msg.type == "message" and msg.model == MODEL and msg.stop_reason == "max_tokens"
    assert msg.usage.input_tokens == 7 and msg.usage.output_tokens == 5
    # The same generator as chat's, for the same conversation (the system prompt first, as vLLM puts it).
    chat = requests.post(f"{engine.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "Be brief."}, *HELLO]}).json()
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert "replica=a1" in msg.content[0].text
    blocks = c.messages.create(model=MODEL, max_tokens=5, system=[{"type": "text", "text": "Be brief."}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": HELLO[0]["content"]}]}])
    assert blocks.content[0].text == msg.content[0].text
    assert c.messages.count_tokens(model=MODEL, system="Be brief.", messages=HELLO).input_tokens == 7


def test_a_messages_stream_has_every_event_the_sdk_parses(fake_engine):
    engine = fake_engine(MODEL)
    c = client(engine.url)
    whole = c.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    with c.messages.stream(model=MODEL, max_tokens=4, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == 4 and final.usage.input_tokens == whole.usage.input_tokens
    raw = requests.post(f"{engine.url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": HELLO,
                                                           "stream": True}, timeout=30)
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    events = [line.split(": ", 1)[1] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert events == ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
                      "content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("body, status, kind", [
    ({"model": "other", "max_tokens": 2, "messages": HELLO}, 404, "NotFoundError"),
    ({"model": MODEL, "messages": HELLO}, 400, "BadRequestError"),
    ({"model": MODEL, "max_tokens": 2, "messages": []}, 400, "BadRequestError"),
    ({"model": MODEL, "max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]}, 400, "BadRequestError"),
])
def test_messages_errors_are_anthropic_shaped_as_vllms(fake_engine, body, status, kind):
    engine = fake_engine(MODEL)
    r = requests.post(f"{engine.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    counted = requests.post(f"{engine.url}/v1/messages/count_tokens", json={"model": "other", "messages": HELLO},
                            timeout=30)
    assert counted.status_code == 404 and counted.json()["error"]["type"] == "NotFoundError"
