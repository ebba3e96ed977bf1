"""The fake engine's pure parts, without a socket: validation, replies, failure pattern, readiness."""
from __future__ import annotations

import json

import pytest

from llmgwctl.engines.fake_config import FakeConfig
from llmgwctl.engines.fake_replies import BadRequest, Chunks, parse_generation, reply_tokens
from llmgwctl.engines.fake_server import FakeEngine


def gen(body, kind="chat", natural=16):
    return parse_generation(body, kind, model="m", replica="r1", natural=natural)


def test_reply_names_replica_model_and_prompt_first():
    assert reply_tokens("m", "r1", "abcdef0123456789", 5) == ["replica=r1", " model=m", " prompt=abcdef012345",
                                                              " lorem", " ipsum"]
    assert reply_tokens("m", "r1", "abc", 1) == ["replica=r1"]
    assert reply_tokens("m", "r1", "abc", 0) == []


@pytest.mark.parametrize("body, finish, count", [
    ({"messages": [{"role": "user", "content": "x"}]}, "stop", 16),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}, "length", 4),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 40}, "stop", 16),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "ignore_eos": True}, "length", 40),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}, "length", 3),
])
def test_reply_length_and_finish_reason(body, finish, count):
    g = gen(body)
    assert (g.finish_reason, len(g.tokens)) == (finish, count)


def test_continue_final_message_goes_on_from_the_partial_message_as_if_never_cut():
    asked = [{"role": "user", "content": "x"}]
    whole = "".join(gen({"messages": asked, "max_tokens": 10}).tokens)
    for cut in (1, 3, 4, 9):
        partial = whole.split(" ")[:cut]
        g = gen({"messages": asked + [{"role": "assistant", "content": " ".join(partial)}],
                 "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 10 - cut})
        assert " ".join(partial) + "".join(g.tokens) == whole
        assert (len(g.tokens), g.finish_reason) == (10 - cut, "length")
        assert g.prompt_tokens == 1 + cut        # the partial message is prompt now
    # Unlimited: the rest of the natural reply, then stop.
    g = gen({"messages": asked + [{"role": "assistant", "content": "a b c d e"}], "continue_final_message": True,
             "add_generation_prompt": False})
    assert (len(g.tokens), g.finish_reason) == (16 - 5, "stop")


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "continue_final_message": True}, "continue_final_message"),     # add_generation_prompt defaults to true
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": False}, "messages"),
])
def test_continue_final_message_is_refused_as_vllm_refuses_it(body, param):
    with pytest.raises(BadRequest) as err:
        gen(body)
    assert err.value.param == param


def test_content_parts_count_as_prompt_text():
    g = gen({"messages": [{"role": "user", "content": [{"type": "text", "text": "one two"}, {"type": "text", "text": "three"}]}]})
    assert g.prompt_tokens == 3


@pytest.mark.parametrize("body, kind, param", [
    ({}, "chat", "messages"),
    ({"messages": []}, "chat", "messages"),
    ({"messages": ["hi"]}, "chat", "messages"),
    ({"prompt": 3}, "text", "prompt"),
    ({"prompt": ["a", "b"]}, "text", "prompt"),
    ({"prompt": "x", "max_tokens": "5"}, "text", "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "text", "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "text", "stream"),
    ({"prompt": "x", "stream": True, "stream_options": []}, "text", "stream_options"),
])
def test_bad_bodies_name_the_parameter(body, kind, param):
    with pytest.raises(BadRequest) as caught:
        gen(body, kind)
    assert caught.value.param == param


def test_chunks_are_valid_json_in_vllm_shape():
    g = gen({"messages": [{"role": "user", "content": 'quote " and \\ backslash'}], "max_tokens": 3, "stream": True})
    c = Chunks(g, 'model "quoted"')
    events = [c.first()] + [c.token(i, last=(i == 2)) for i in range(3)] + [c.usage({"completion_tokens": 3})]
    bodies = [json.loads(e.decode()[len("data: "):]) for e in events]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [b["choices"][0]["delta"]["content"] for b in bodies[1:4]] == g.tokens
    assert [b["choices"][0]["finish_reason"] for b in bodies[1:4]] == [None, None, "length"]
    assert bodies[4]["choices"] == [] and bodies[4]["usage"] == {"completion_tokens": 3}
    assert {b["model"] for b in bodies} == {'model "quoted"'} and len({b["id"] for b in bodies}) == 1


def test_fail_rate_spreads_failures_evenly():
    engine = FakeEngine(FakeConfig(model="m", fail_rate=0.3))
    pattern = [engine.should_fail() for _ in range(10)]
    assert sum(pattern) == 3
    assert pattern == [False, False, False, True, False, False, True, False, False, True]


def test_ready_after_startup_delay_on_an_injected_clock():
    now = [100.0]
    engine = FakeEngine(FakeConfig(model="m", startup_delay=5), clock=lambda: now[0])
    assert not engine.ready()
    now[0] = 104.9
    assert not engine.ready()
    now[0] = 105.0
    assert engine.ready()
