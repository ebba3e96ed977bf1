"""What the fake engine says on Anthropic's Messages API, as vLLM says it: pure functions of the request.

vLLM serves `POST /v1/messages` by turning the request into a chat one
(the `system` prompt first, as one system message) and its answer back
into Anthropic's shapes; the fake does the same, so one reply generator
(fake_replies) answers both APIs and a test can compare them:

- `as_chat(body)`: a Messages body as the chat body the fake generates
  for (BadRequest for what vLLM refuses: no `max_tokens`, no messages);
- `reply(...)`: the whole answer, fields in vLLM's order (`content`
  before `model`);
- `Events`: a stream's events, the types the `anthropic` SDK parses
  (`message_start`, `content_block_start`, `ping`, `content_block_delta`,
  `content_block_stop`, `message_delta`, `message_stop`), each as
  `event: TYPE` + `data: JSON`;
- `error_response(...)`: vLLM's Anthropic-shaped error, its `type` the
  name of vLLM's error class, as vLLM's Messages routes translate theirs.
"""
from __future__ import annotations

import json
import uuid
from functools import partial
from typing import Any

from aiohttp import web

from .fake_replies import BadRequest, Generation

__all__ = ["Events", "as_chat", "error_response", "reply"]

_dumps = partial(json.dumps, separators=(",", ":"))

# vLLM's stop_reason_map: the chat finish reasons as Anthropic's.
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_response(status: int, message: str, type_: str) -> web.Response:
    return web.json_response({"type": "error", "error": {"type": type_, "message": message}}, status=status,
                             dumps=_dumps)


def _text(content: Any, where: str) -> str:
    """A content value's text: a string, or text blocks joined (other blocks add nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return "".join(str(b.get("text", "")) for b in content if b.get("type") == "text")
    raise BadRequest(f"'{where}' must be a string or a list of content blocks", where)


def as_chat(body: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """The chat request vLLM would make of a Messages (or, `counting`, a count_tokens) body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            chat.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}] must be an object with role 'user' or 'assistant'", "messages")
        chat.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")})
    if counting:
        return {"messages": chat}
    limit = body.get("max_tokens")
    if limit is None:
        raise BadRequest("'max_tokens' is required", "max_tokens")
    stream = body.get("stream", False)
    return {"messages": chat, "max_tokens": limit, "stream": stream}


def reply(gen: Generation, model: str) -> dict[str, Any]:
    """The whole answer, as vLLM's AnthropicMessagesResponse dumps it."""
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "".join(gen.tokens)}], "model": model,
            "stop_reason": _STOP.get(gen.finish_reason, "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": len(gen.tokens)}}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {_dumps({'type': kind, **payload})}\n\n".encode()


class Events:
    """The events of one Messages stream, with the chat `Chunks`' interface (first, token, empty_finish, end)."""

    def __init__(self, gen: Generation, model: str):
        self.gen = gen
        self.model = model
        self._prefix = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,' \
                       b'"delta":{"type":"text_delta","text":'

    def first(self) -> bytes:
        start: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.gen.prompt_tokens, "output_tokens": 0}}
        return (_event("message_start", {"message": start})
                + _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                + _event("ping", {}))

    def token(self, i: int, last: bool) -> bytes:
        return self._prefix + json.dumps(self.gen.tokens[i]).encode() + b"}}\n\n"

    def empty_finish(self) -> bytes:
        return b""

    def end(self, usage: dict[str, Any]) -> bytes:
        # vLLM's message_delta repeats the input count beside the output one.
        return (_event("content_block_stop", {"index": 0})
                + _event("message_delta", {"delta": {"stop_reason": _STOP.get(self.gen.finish_reason, "end_turn"),
                                                     "stop_sequence": None},
                                           "usage": {"input_tokens": usage["prompt_tokens"],
                                                     "output_tokens": usage["completion_tokens"]}})
                + _event("message_stop", {}))
