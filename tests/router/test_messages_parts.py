"""The Messages route's parts on their own: the error shape, the usage reading, the prompt, and the name echoed back."""
from __future__ import annotations

import json

import pytest
from aiohttp import web

from llmgwctl.router import errors, routes
from llmgwctl.router.echo import Echo
from llmgwctl.router.policies.prefix import BLOCK_CHARS, MAX_BLOCKS, chat_prompt, messages_prompt
from llmgwctl.router.shapes import ANTHROPIC, OPENAI, anthropic_type
from llmgwctl.router.usage import MESSAGES, MessagesStreamUsage, messages_tokens

# -- the route table -----------------------------------------------------------------------------


def test_the_messages_routes_are_entries_with_their_own_shape_prompt_and_usage():
    messages, count = routes.BY_PATH["/v1/messages"], routes.BY_PATH["/v1/messages/count_tokens"]
    assert messages.streams and messages.prompt is messages_prompt and messages.usage is MESSAGES
    assert messages.error_shape is ANTHROPIC and count.error_shape is ANTHROPIC
    assert not count.streams and count.prompt is None and count.usage.whole(b'{"input_tokens":9}') is None
    # Every other route keeps OpenAI's shape.
    assert all(r.error_shape is OPENAI for r in routes.TABLE if not r.path.startswith("/v1/messages"))


# -- the error shape -----------------------------------------------------------------------------

@pytest.mark.parametrize(("refusal", "kind"), [
    (errors.missing_model(), "invalid_request_error"),
    (errors.unknown_model("nope", ["m"]), "not_found_error"),
    (errors.too_large(10), "request_too_large"),
    (errors.queue_full("m", 3), "rate_limit_error"),
    (errors.no_replica("m"), "overloaded_error"),
    (errors.upstream_failed("m", "r1: refused"), "api_error"),
    (errors.response(401, "a key", "invalid_request_error", "invalid_api_key",
                     headers={"WWW-Authenticate": "Bearer"}), "authentication_error"),
    (errors.response(403, "not yours", "invalid_request_error", "model_not_allowed"), "permission_error"),
])
def test_a_refusal_in_anthropics_shape_keeps_its_status_message_and_headers(refusal: web.Response, kind: str):
    shaped = ANTHROPIC.whole(refusal)
    doc = json.loads(shaped.body)
    assert doc == {"type": "error", "error": {"type": kind, "message": json.loads(refusal.body)["error"]["message"]}}
    assert shaped.status == refusal.status and shaped.content_type == "application/json"
    for name in ("Retry-After", "WWW-Authenticate"):
        assert shaped.headers.get(name) == refusal.headers.get(name)
    assert OPENAI.whole(refusal) is refusal


def test_anthropic_types_by_status_cover_what_the_sdk_maps():
    assert [anthropic_type(s) for s in (400, 401, 403, 404, 429, 500, 502, 503, 504, 529)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "rate_limit_error",
        "api_error", "api_error", "overloaded_error", "api_error", "overloaded_error"]


def test_stream_errors_are_an_error_event_in_anthropics_shape_and_a_data_event_in_openais():
    refusal = errors.cold_timeout("m", 5)
    event = ANTHROPIC.event(refusal)
    head, data = event.split(b"\n", 1)
    assert head == b"event: error" and data.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(data[6:])["error"]["type"] == "overloaded_error"
    assert OPENAI.event(refusal) == b"data: " + refusal.body + b"\n\n"
    died = errors.stream_error_event("r1: reset", ANTHROPIC)
    assert died.startswith(b"event: error\ndata: ")
    assert json.loads(died.split(b"data: ", 1)[1])["error"] == {
        "type": "api_error", "message": "the engine stopped mid-stream: r1: reset"}
    assert errors.stream_error_event("r1: reset").startswith(b'data: {"error"')
    # An engine's own error to a stream already open: passed on as an event of the route's shape.
    theirs = b'{"type":"error","error":{"type":"BadRequestError","message":"no"}}'
    assert ANTHROPIC.engine_event(theirs + b"\n") == b"event: error\ndata: " + theirs + b"\n\n"
    openai_shaped = b'{"error":{"message":"bad","type":"BadRequestError","code":400}}'
    assert json.loads(ANTHROPIC.engine_event(openai_shaped).split(b"data: ", 1)[1])["error"]["message"] == "bad"
    assert ANTHROPIC.engine_event(b"<html>") is None and OPENAI.engine_event(b"<html>") is None


# -- usage -------------------------------------------------------------------------------------

REPLY = (b'{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"the \\"usage\\" '
         b'is"}],"model":"m","stop_reason":"end_turn","stop_sequence":null,'
         b'"usage":{"input_tokens":12,"cache_creation_input_tokens":3,"cache_read_input_tokens":5,"output_tokens":7}}')
STREAM = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
          b'"role":"assistant","content":[],"model":"m","usage":{"input_tokens":11,"output_tokens":0}}}\n\n'
          b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
          b'"content_block":{"type":"text","text":""}}\n\n'
          + b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":" tok"}}\n\n' * 3
          + b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
            b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
            b'"usage":{"output_tokens":20}}\n\n'
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


def test_a_messages_reply_is_metered_as_prompt_and_completion_tokens_with_its_cached_parts():
    assert messages_tokens(REPLY) == (12 + 3 + 5, 7)
    assert messages_tokens(b'{"usage":{"input_tokens":4,"output_tokens":2}}') == (4, 2)
    assert messages_tokens(b'{"input_tokens":4}') is None
    # OpenAI's names are not Anthropic's.
    assert messages_tokens(b'{"usage":{"prompt_tokens":4,"completion_tokens":2}}') is None


def test_a_messages_stream_takes_input_from_message_start_and_output_from_message_delta_wherever_cut():
    for cut in range(1, len(STREAM)):
        scan = MessagesStreamUsage()
        scan.feed(STREAM[:cut])
        scan.feed(STREAM[cut:])
        assert scan.usage == (11, 20), cut
    scan = MESSAGES.stream()
    scan.feed(STREAM.split(b"event: content_block_start")[0])
    assert scan.usage == (11, 0)        # a stream cut after message_start still counts its prompt


# -- the prompt for prefix routing -----------------------------------------------------------

def test_the_messages_prompt_is_the_system_prompt_then_the_chat():
    system = "You are the ACME desk. " * 30
    doc = {"system": system, "messages": [{"role": "user", "content": "hello"}]}
    blocks = {"system": [{"type": "text", "text": system[:100]}, {"type": "text", "text": system[100:]}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image"}]}]}
    assert messages_prompt(doc) == messages_prompt(blocks) == f"<|system|>\n{system}\n" + chat_prompt(doc)
    # The same leading string as a chat request with that system message: one prefix, whichever API sent it.
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]}
    assert messages_prompt(doc) == chat_prompt(chat)
    assert messages_prompt({"messages": [{"role": "user", "content": "x"}]}) == chat_prompt(
        {"messages": [{"role": "user", "content": "x"}]})
    assert messages_prompt({"system": "s", "messages": "not a list"}) == "<|system|>\ns\n"
    assert messages_prompt({"messages": 3}) is None
    huge = messages_prompt({"system": "x" * (MAX_BLOCKS * BLOCK_CHARS * 2), "messages": []})
    assert huge is not None and len(huge) == MAX_BLOCKS * BLOCK_CHARS


# -- the name echoed back -----------------------------------------------------------------------

CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"org/real-1","choices":[' \
        b'{"index":0,"delta":{"content":"say \\"model\\":\\"org/real-1\\""}}]}\n\n'


def test_a_whole_reply_names_the_asked_model_only_at_its_top_level():
    echo = Echo("org/real-1", "fast")
    chat = b'{"id":"x","object":"chat.completion","model":"org/real-1","choices":[{"message":{"content":"hi"}}]}'
    assert json.loads(echo.whole(chat))["model"] == "fast"
    assert echo.whole(chat).replace(b'"fast"', b'"org/real-1"') == chat
    # A tool's input (an object in a Messages reply) may hold a "model" of its own: untouched.
    tool = (b'{"id":"m","type":"message","content":[{"type":"tool_use","input":{"model":"org/real-1"}}],'
            b'"model":"org/real-1","usage":{"input_tokens":1,"output_tokens":1}}')
    doc = json.loads(echo.whole(tool))
    assert doc["model"] == "fast" and doc["content"][0]["input"] == {"model": "org/real-1"}
    # Escaped slashes, pretty-printed JSON, another model's name.
    assert json.loads(echo.whole(b'{"model" : "org\\/real-1"}'))["model"] == "fast"
    assert echo.whole(b'{"model":"org/real-10"}') == b'{"model":"org/real-10"}'
    assert echo.whole(b'{"choices":[{"model":"org/real-1"}]}') == b'{"choices":[{"model":"org/real-1"}]}'
    assert echo.whole(b"not json") == b"not json"


def test_a_stream_names_the_asked_model_in_every_chunk_wherever_the_socket_cut_it():
    stream = CHUNK * 3 + b"data: [DONE]\n\n"
    want = stream.replace(b'"model":"org/real-1"', b'"model":"fast"')
    assert want.count(b'"model":"fast"') == 3 and want.count(b'\\"model\\":\\"org/real-1\\"') == 3
    for cut in range(1, len(stream)):
        echo = Echo("org/real-1", "fast")
        out = echo.chunk(stream[:cut]) + echo.chunk(stream[cut:]) + echo.rest()
        assert out == want, cut
    echo = Echo("org/real-1", "fast")
    assert b"".join(echo.chunk(stream[i:i + 1]) for i in range(len(stream))) + echo.rest() == want
    # A read that ends a line is passed on whole, at once: nothing is held back.
    echo = Echo("org/real-1", "fast")
    assert echo.chunk(CHUNK) == CHUNK.replace(b'"model":"org/real-1"', b'"model":"fast"') and echo.rest() == b""


def test_what_a_stream_holds_back_is_bounded_by_the_names_length():
    echo = Echo("m", "alias")
    text = b'data: {"choices":[{"delta":{"content":"' + b"x" * 5000
    out = echo.chunk(text)
    assert len(text) - len(out) < 20 and text.startswith(out)
    assert out + echo.rest() == text
