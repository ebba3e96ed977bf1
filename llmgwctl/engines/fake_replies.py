"""What the fake engine says, without the serving: pure functions of the request.

vLLM's error answer, validating a completion body, the deterministic reply (who answered, a digest
of the prompt, filler), the SSE chunk bytes in vLLM's shapes, and embedding
vectors. Kept apart from the server so they are tested without a socket and
the server module is only about serving.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .errors import EngineError


class BadRequest(EngineError):
    """The request body is not something an OpenAI server would accept."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    # vLLM's ErrorResponse: the OpenAI envelope with `code` set to the HTTP status.
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, type_, status, param), status=status, dumps=_compact)


def _compact(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


# Filler vocabulary after the identity tokens. Fixed so replies are deterministic.
_FILLER = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")


def digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def reply_tokens(model: str, replica: str, prompt_digest: str, count: int) -> list[str]:
    """The reply: who answered, to what, then filler; `count` tokens, each a word.

    The identity comes first so even a short max_tokens shows the replica.
    """
    words = [f"replica={replica}", f"model={model}", f"prompt={prompt_digest[:12]}"]
    words += [_FILLER[i % len(_FILLER)] for i in range(max(0, count - len(words)))]
    words = words[:count]
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def count_prompt_tokens(text: str) -> int:
    # A whitespace count stands in for a tokenizer: deterministic and cheap.
    return max(1, len(text.split()))


def embedding_vector(item: Any, dim: int) -> list[float]:
    """A unit vector that depends only on the input: same text, same vector."""
    seed = digest(item).encode()
    raw: list[float] = []
    block = 0
    while len(raw) < dim:
        h = hashlib.sha256(seed + block.to_bytes(4, "little")).digest()
        raw += [(b - 127.5) / 127.5 for b in h]
        block += 1
    raw = raw[:dim]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


@dataclass(slots=True)
class Generation:
    """One validated completion request, and the reply it will get."""

    kind: str                  # "chat" or "text"
    stream: bool
    include_usage: bool
    prompt_tokens: int
    tokens: list[str]
    finish_reason: str


def parse_generation(body: dict[str, Any], kind: str, *, model: str, replica: str, natural: int) -> Generation:
    """Validate a completion request body and decide its reply; BadRequest says what is wrong.

    `natural` is the reply length when the client sets no limit.
    """
    done = 0
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        texts = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):   # content parts: [{"type": "text", "text": ...}]
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            texts.append(str(content or ""))
        prompt_text, prompt_digest = " ".join(texts), digest(messages)
        done = _continued(body, messages, texts)
        if done:
            # The reply to the conversation before the partial message,
            # from the word the partial one ends at: deterministic, so a
            # stream continued elsewhere reads as if it had never been cut.
            prompt_digest = digest(messages[:-1])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string (batched prompts are not supported)", "prompt")
        prompt_text, prompt_digest = prompt, digest(prompt)

    limit_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(limit_key)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise BadRequest(f"'{limit_key}' must be a positive integer, got {limit!r}", limit_key)
    left = max(0, natural - done)       # what the whole reply has left after the partial message
    if limit is None:
        count, finish = left, "stop"
    elif body.get("ignore_eos"):
        # vLLM's extension: generate exactly max_tokens; benchmarks use it for long streams.
        count, finish = limit, "length"
    else:
        count, finish = min(limit, left), ("length" if limit < left else "stop")

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return Generation(
        kind=kind, stream=stream, include_usage=bool(stream and options.get("include_usage")),
        prompt_tokens=count_prompt_tokens(prompt_text),
        tokens=reply_tokens(model, replica, prompt_digest, done + count)[done:],
        finish_reason=finish,
    )


def _continued(body: dict[str, Any], messages: list[Any], texts: list[str]) -> int:
    """Words of the final assistant message a `continue_final_message` request continues (0: none).

    As vLLM: the flag needs `add_generation_prompt: false` and the
    assistant's message last. A word stands for a token, as in the prompt count.
    """
    if not body.get("continue_final_message"):
        return 0
    if body.get("add_generation_prompt", True):
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                         "continue_final_message")
    if messages[-1].get("role") != "assistant":
        raise BadRequest("continue_final_message needs the assistant's message last", "messages")
    return len(texts[-1].split())


class Chunks:
    """SSE chunk bytes for one stream, in vLLM's shapes.

    Everything but the token text is fixed per stream, so each chunk is a
    pre-built prefix + the JSON-escaped token + a pre-built suffix.
    """

    def __init__(self, gen: Generation, model: str):
        self.gen = gen
        created = int(time.time())
        if gen.kind == "chat":
            self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                         "created": created, "model": model}
        else:
            self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                         "created": created, "model": model}
        head = json.dumps(self.head, separators=(",", ":"))[:-1]   # without the closing brace
        if gen.kind == "chat":
            self._prefix = f'data: {head},"choices":[{{"index":0,"delta":{{"content":'.encode()
            self._suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            self._last_suffix = (f'}},"logprobs":null,"finish_reason":"{gen.finish_reason}",'
                                 f'"stop_reason":null}}]}}\n\n').encode()
        else:
            self._prefix = f'data: {head},"choices":[{{"index":0,"text":'.encode()
            self._suffix = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self._last_suffix = (f',"logprobs":null,"finish_reason":"{gen.finish_reason}",'
                                 f'"stop_reason":null}}]}}\n\n').encode()

    def _event(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({**self.head, **payload}, separators=(",", ":")).encode() + b"\n\n"

    def first(self) -> bytes:
        # vLLM's chat stream opens with the role and empty content; completions have no such chunk.
        if self.gen.kind != "chat":
            return b""
        return self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})

    def token(self, i: int, last: bool) -> bytes:
        text = json.dumps(self.gen.tokens[i]).encode()
        return self._prefix + text + (self._last_suffix if last else self._suffix)

    def empty_finish(self) -> bytes:
        if self.gen.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.gen.finish_reason,
                      "stop_reason": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": self.gen.finish_reason,
                      "stop_reason": None}
        return self._event({"choices": [choice]})

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self._event({"choices": [], "usage": usage})

    def end(self, usage: dict[str, Any]) -> bytes:
        """The stream's last bytes: its usage chunk when asked for (stream_options.include_usage), then [DONE]."""
        return (self.usage(usage) if self.gen.include_usage else b"") + b"data: [DONE]\n\n"
