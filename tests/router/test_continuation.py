"""A chat stream whose engine is SIGKILLed mid-way, end to end: real fake engines, a real router, the openai SDK.

With `continuation` on, the stream goes on from another replica and the
client reads one stream with one id; the fake engine continues a
`continue_final_message` request deterministically from the partial text,
so the whole text must be exactly the reply the killed replica would have
given. Off, or for a request a resumed generation could change, the stream
ends with the error event as it always did.
"""
from __future__ import annotations

import logging
import threading

import openai
import pytest
import requests

from llmgwctl.catalog import Model, Profile
from llmgwctl.engines.fake_replies import digest, reply_tokens

from ..support import wait_until
from .harness import catalog, make_router

MODEL = "m"
ASKED = [{"role": "user", "content": "tell me more"}]
# Paced so the kill lands mid-stream: 40 tokens at 20 a second run 2 s.
PACE = ("--tokens-per-second", "20")
TOKENS = 40


def model(continuation: int) -> Model:
    return Model(name=MODEL, source="org/m", profiles=(Profile(name="default", engine="fake", gpus=0),),
                 continuation=continuation)


def whole_reply(replica: str, tokens: int = TOKENS) -> str:
    """What `replica` answers ASKED in one piece: the text a continued stream must equal."""
    return "".join(reply_tokens(MODEL, replica, digest(ASKED), tokens))


def cut_stream(engines, routers, continuation: int, replicas: int = 2, kills: int = 1, extra: dict | None = None):
    """A stream killed `kills` times, each after 4 more chunks: (chunks read, error raised or None, names, router)."""
    names = "abc"[:replicas]
    running = {n: engines(MODEL, n, *PACE) for n in names}
    rt = routers(make_router(catalog(model(continuation))))
    rt.set_endpoints([e.endpoint() for e in running.values()])
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASKED, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True},
        # Exactly TOKENS (vLLM's ignore_eos): longer than the fake's natural reply.
        extra_body={"ignore_eos": True, **(extra or {})})
    victims = [raw.headers["x-llmgw-replica"]]
    got, error = [], None
    try:
        for chunk in raw.parse():
            got.append(chunk)
            if len(victims) <= kills and sum(1 for c in got if c.choices and c.choices[0].delta.content) \
                    == 4 * len(victims):
                running[victims[-1]].kill()
                if len(victims) < kills:
                    # The next victim is whichever replica the router picks: the one not yet killed
                    # when there are two left, so kill order is known only for three replicas.
                    victims.append(_busy(running, victims))
                else:
                    victims.append("")
    except openai.APIError as exc:
        error = exc
    return got, error, victims[0], rt


def _busy(running, killed) -> str:
    """The replica (not yet killed) running a request now: where the router continued the stream."""
    return wait_until(lambda: next((n for n, e in running.items() if n not in killed and e.load().running), None),
                      what="the continuation to reach a replica")


def text_of(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_stream_cut_by_a_killed_engine_continues_on_another_replica_as_one_stream(engines, routers, caplog):
    def access_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "llmgw.access"]
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        got, error, victim, rt = cut_stream(engines, routers, continuation=2)
        # The router writes the access line once the answer is done, which can be just after the
        # client has read the stream's last chunk.
        (line,) = wait_until(access_lines, what="the access log line of the continued stream")
    assert error is None
    # One stream: one id, one role delta, the text exactly the killed replica's whole reply.
    assert len({c.id for c in got}) == 1 and len({c.created for c in got}) == 1 and {c.model for c in got} == {MODEL}
    assert sum(1 for c in got if c.choices and c.choices[0].delta.role) == 1
    assert text_of(got) == whole_reply(victim)
    assert [c.choices[0].finish_reason for c in got if c.choices][-1] == "length"
    # The usage chunk: the original prompt (3 words), the completion of both parts.
    assert got[-1].choices == [] and got[-1].usage is not None
    assert (got[-1].usage.prompt_tokens, got[-1].usage.completion_tokens) == (3, TOKENS)
    # The access log records the hand-over, the metric counts it.
    survivor = "b" if victim == "a" else "a"
    assert f"endpoint={survivor}" in line and f"continued={victim}>{survivor}@" in line
    assert " 200 " in line and f"tokens=3/{TOKENS}" in line
    cut = int(line.rsplit("@", 1)[1].split()[0])
    assert 4 <= cut < TOKENS
    page = requests.get(rt.url + "/metrics", timeout=5).text
    assert f'llmgw_router_stream_continuations_total{{model="{MODEL}",outcome="resumed"}} 1.0' in page


def test_a_stream_cut_twice_continues_twice_within_its_attempts(engines, routers):
    got, error, victim, _ = cut_stream(engines, routers, continuation=2, replicas=3, kills=2)
    assert error is None
    assert len({c.id for c in got}) == 1
    assert sum(1 for c in got if c.choices and c.choices[0].delta.role) == 1
    assert text_of(got) == whole_reply(victim)
    assert got[-1].usage.completion_tokens == TOKENS


def test_past_its_attempts_a_cut_stream_ends_with_the_error_event(engines, routers):
    got, error, victim, rt = cut_stream(engines, routers, continuation=1, replicas=3, kills=2)
    assert isinstance(error, openai.APIError) and "stopped mid-stream" in str(error)
    # What came before the second cut is still the one reply, without gap or repeat.
    assert whole_reply(victim).startswith(text_of(got)) and len({c.id for c in got}) == 1
    page = requests.get(rt.url + "/metrics", timeout=5).text
    assert f'llmgw_router_stream_continuations_total{{model="{MODEL}",outcome="failed"}} 1.0' in page


def test_with_continuation_off_the_cut_stream_ends_with_the_error_event(engines, routers):
    got, error, victim, _ = cut_stream(engines, routers, continuation=0)
    assert isinstance(error, openai.APIError) and "stopped mid-stream" in str(error)
    assert whole_reply(victim).startswith(text_of(got))


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    {"n": 2},
    {"logprobs": True},
    {"response_format": {"type": "json_object"}},
], ids=["tools", "n=2", "logprobs", "response_format"])
def test_a_request_a_resumed_generation_could_change_ends_with_the_error_event(engines, routers, extra):
    got, error, victim, rt = cut_stream(engines, routers, continuation=2, extra=extra)
    assert isinstance(error, openai.APIError) and "stopped mid-stream" in str(error)
    page = requests.get(rt.url + "/metrics", timeout=5).text
    assert f'llmgw_router_stream_continuations_total{{model="{MODEL}",outcome="ineligible"}} 1.0' in page


def test_with_no_other_replica_the_cut_stream_ends_with_the_error_event(engines, routers):
    got, error, victim, rt = cut_stream(engines, routers, continuation=2, replicas=1)
    assert isinstance(error, openai.APIError) and "stopped mid-stream" in str(error)
    page = requests.get(rt.url + "/metrics", timeout=5).text
    assert f'llmgw_router_stream_continuations_total{{model="{MODEL}",outcome="failed"}} 1.0' in page


def test_a_stream_cut_before_its_first_token_is_answered_whole_by_another_replica(engines, routers):
    # The engine sends its stream's headers at once and its first token only
    # after --ttft: killed in between, the client got headers and no text.
    slow = engines(MODEL, "slow", "--ttft", "60")
    fast = engines(MODEL, "fast")
    rt = routers(make_router(catalog(model(2))))
    rt.set_endpoints([slow.endpoint(priority=10), fast.endpoint()])     # the slow one is picked first
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    box: list = []

    def read() -> None:
        try:
            box.append(list(client.chat.completions.create(
                model=MODEL, messages=ASKED, max_tokens=TOKENS, stream=True, extra_body={"ignore_eos": True})))
        except Exception as exc:  # noqa: BLE001 -- a thread hands any failure to the test, whose assertion says what it was
            box.append(exc)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: (slow.load().running or 0) == 1, what="the stream to reach the slow replica")
    slow.kill()
    reader.join(30)
    (got,) = box
    assert isinstance(got, list), got
    assert len({c.id for c in got}) == 1 and sum(1 for c in got if c.choices and c.choices[0].delta.role) == 1
    assert text_of(got) == whole_reply("fast")
