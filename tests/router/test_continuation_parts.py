"""Stream continuation's pure parts: which requests may be continued, the continuation's body, the splice."""
from __future__ import annotations

import json

import pytest

from llmgwctl.router.continuation import MAX_EVENT, Splice, continuation_body, refusal

ASKED = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("extra, why", [
    ({}, None),
    ({"tools": [], "tool_choice": "none", "logprobs": False, "top_logprobs": 0, "n": 1,
      "response_format": {"type": "text"}, "temperature": 0, "stop": ["\n"], "seed": 1}, None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": {"type": "object"}}, "guided decoding"),
    ({"guided_regex": "a+"}, "guided decoding"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "guided decoding"),
    ({"n": 2}, "n > 1"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 5}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"continue_final_message": True}, "an assistant prefill"),
    ({"messages": ASKED + [{"role": "assistant", "content": "Once"}]}, "an assistant prefill"),
    ({"messages": []}, "no messages"),
])
def test_only_requests_a_resumed_generation_cannot_change_may_be_continued(extra, why):
    assert refusal({"model": "m", "messages": ASKED, "stream": True, **extra}) == why


def test_the_continuation_asks_to_continue_the_text_so_far_within_what_is_left():
    doc = {"model": "alias", "messages": ASKED, "max_tokens": 10, "max_completion_tokens": 12, "min_tokens": 3,
           "stream": True, "temperature": 0}
    body = json.loads(continuation_body(doc, "m", "Once upon", 4))
    assert body["messages"] == ASKED + [{"role": "assistant", "content": "Once upon"}]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (6, 8, 0)
    assert (body["model"], body["stream"], body["temperature"]) == ("m", True, 0)
    assert doc["messages"] == ASKED and doc["max_tokens"] == 10      # the original is left as it was
    # Nothing sent yet: the request itself, to answer whole.
    assert json.loads(continuation_body(doc, "m", "", 0)) == {**doc, "model": "m"}
    # Every token allowed was sent: nothing to continue.
    assert continuation_body(doc, "m", "a b c", 10) == "max_tokens 10 reached at the cut"


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(cid: str, content: str | None = None, *, role: bool = False, finish: str | None = None, usage=None,
          created: int = 1) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content is not None else {})
    obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": cid + "-model",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return event(obj)


def parse(data: bytes) -> list:
    return [json.loads(line[6:]) if line.startswith(b"data: {") else line.decode()
            for line in data.split(b"\n\n") if line]


def test_the_first_stream_passes_whole_events_unchanged_and_a_cut_event_never_reaches_the_client():
    s = Splice({"messages": ASKED}, attempts=2)
    first = chunk("A", role=True) + chunk("A", "Once")
    # An event split between two reads is held back until its end arrives.
    part = chunk("A", " upon")
    assert s.feed(first + part[:20]) == first
    assert s.feed(part[20:]) == part
    # The engine dies with half an event sent: the half never goes out.
    assert s.feed(chunk("A", " a")[:30]) == b""
    s.cut()
    assert "".join(s.text) == "Once upon" and s.sent == 2 and s.role_sent and s.ended is None


def test_a_later_part_is_rewritten_onto_the_first_one_role_delta_usage_of_both_parts():
    s = Splice({"messages": ASKED}, attempts=2)
    s.feed(chunk("A", role=True, created=100) + chunk("A", "Once") + chunk("A", " upon"))
    s.cut()
    usage = {"prompt_tokens": 7 + 2, "completion_tokens": 2, "total_tokens": 13}
    out = s.feed(chunk("B", role=True, created=200) + chunk("B", " a") + chunk("B", " time", finish="length")
                 + event({"id": "B", "object": "chat.completion.chunk", "created": 200, "model": "B-model",
                          "choices": [], "usage": usage}) + b"data: [DONE]\n\n")
    events = parse(out)
    assert events[-1] == "data: [DONE]"
    chunks = events[:-1]
    assert [(c["id"], c["created"], c["model"]) for c in chunks] == [("A", 100, "A-model")] * 3
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"content": " a"}, {"content": " time"}]
    # The original prompt (the continuation's, less the text it was given) and both parts' completion.
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    assert s.ended is not None        # finished: nothing more to continue


def test_per_chunk_usage_counts_the_tokens_sent_and_is_rewritten_in_every_later_chunk():
    s = Splice({"messages": ASKED}, attempts=2)
    s.feed(chunk("A", role=True, usage={"prompt_tokens": 5, "completion_tokens": 0})
           + chunk("A", "Once upon", usage={"prompt_tokens": 5, "completion_tokens": 2}))
    s.cut()
    assert s.sent == 2 and s.prompt == 5       # two tokens in one delta: the engine's count, not the deltas'
    out = parse(s.feed(chunk("B", " a", usage={"prompt_tokens": 9, "completion_tokens": 1})))
    assert out[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert s.sent == 3


@pytest.mark.parametrize("delta, why", [
    ({"content": "x"}, None),
    ({"reasoning_content": "hmm"}, "reasoning deltas"),
    ({"tool_calls": [{"index": 0}]}, "tool-call deltas"),
])
def test_a_stream_that_carries_what_text_cannot_resume_is_not_continued(delta, why):
    s = Splice({"messages": ASKED}, attempts=2)
    s.feed(event({"id": "A", "created": 1, "model": "m", "choices": [{"index": 0, "delta": delta}]}))
    assert s.ended == why


def test_an_endless_event_ends_the_watch_and_passes_as_it_came():
    s = Splice({"messages": ASKED}, attempts=2)
    blob = b"data: " + b"x" * (MAX_EVENT + 1)
    assert s.feed(blob) == blob and s.ended is not None
    assert s.feed(b"more") == b"more"
