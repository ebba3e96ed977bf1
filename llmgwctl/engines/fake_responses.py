"""The fake engine's Responses API (`/v1/responses`): a chat generation, stored per process as vLLM stores it.

vLLM keeps every response it made (with VLLM_ENABLE_RESPONSES_API_STORE=1)
in its API server's memory: a request naming one it does not hold --
`previous_response_id`, `GET /v1/responses/{id}` -- gets a 404, which is
what a router without affinity runs into on every other turn. `Book` is
that store here: the response and the conversation up to it (the input
items, then its output), bounded (`MAX_KEPT`, the oldest first out).

The reply is the chat reply (fake_replies.py) to the whole conversation,
so its `prompt=` word changes with every turn and `replica=` says who
answered. Shapes are the OpenAI SDK's (`openai.types.responses`): the
Response object, and the stream's events in vLLM's order (created,
in_progress, output_item.added, content_part.added, output_text.delta...,
output_text.done, content_part.done, output_item.done, completed), each
`event: TYPE` and `data: JSON` with a `sequence_number`.

The shapes are pure functions; `Routes` serves them on the fake engine's app.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .fake_load import prompt_tokens_of
from .fake_replies import BadRequest, error_response, parse_generation

if TYPE_CHECKING:
    from .fake_server import FakeEngine

# Responses kept per process: far more than any test makes, and a bound on
# what a long benchmark run can make the fake hold.
MAX_KEPT = 10_000


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]            # the input items of every turn up to it, and its outputs, in order
    inputs: list[dict[str, Any]]           # this turn's input items, with ids (input_items)


class Book:
    """The responses this process made, by id; at most MAX_KEPT, the oldest first out."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._kept.get(response_id)

    def put(self, stored: Stored) -> None:
        self._kept[stored.response["id"]] = stored
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's `input` as message items with ids: a string is one user message."""
    given = body.get("input")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise BadRequest("'input' must be a string or a non-empty list of input items", "input")
    items = []
    for i, item in enumerate(given):
        if not isinstance(item, dict) or not isinstance(item.get("role", "user"), str):
            raise BadRequest(f"input[{i}] must be an object with a string 'role'", "input")
        content = item.get("content", "")
        if isinstance(content, str):
            content = [{"type": "input_text", "text": content}]
        elif not isinstance(content, list):
            raise BadRequest(f"input[{i}].content must be a string or a list of content parts", "input")
        items.append({"id": item.get("id") or f"msg_{uuid.uuid4().hex}", "type": "message",
                      "role": item.get("role", "user"), "content": content, "status": "completed"})
    return items


def chat_messages(instructions: Any, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages, what the reply is generated from."""
    messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    for item in items:
        text = " ".join(str(p.get("text", "")) for p in item.get("content", ()) if isinstance(p, dict))
        messages.append({"role": item.get("role", "user"), "content": text})
    return messages


def response_object(response_id: str, model: str, body: dict[str, Any], text: str, status: str,
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Response as vLLM returns it (what `openai.types.responses.Response` parses)."""
    output = []
    if status == "completed":
        output = [{"id": f"msg_{response_id[5:]}", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]}]
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": status, "output": output, "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata"),
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
        "background": False, "store": body.get("store", True) is not False, "truncation": "disabled",
        "incomplete_details": None, "error": None, "text": {"format": {"type": "text"}},
        "usage": usage, "user": body.get("user"),
    }


def usage_of(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class Events:
    """One stream's SSE events, numbered in order."""

    def __init__(self, response: dict[str, Any]):
        self.response = response
        self.seq = 0
        self.item_id = f"msg_{response['id'][5:]}"

    def _event(self, kind: str, **payload: Any) -> bytes:
        # vLLM's field order: the payload (the response first, its id first), then these two.
        data = {**payload, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def opening(self) -> bytes:
        """created, in_progress, and the empty message and text part the deltas fill."""
        base = {**self.response, "status": "in_progress", "output": [], "usage": None}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return b"".join((
            self._event("response.created", response=base),
            self._event("response.in_progress", response=base),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                        part=part),
        ))

    def delta(self, text: str) -> bytes:
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def closing(self, text: str) -> bytes:
        """The text done, the part and the message done, and the whole response completed."""
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "completed",
                "content": [part]}
        return b"".join((
            self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                        text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event("response.completed", response=self.response),
        ))


def page(items: list[dict[str, Any]]) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: one page of every item."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}



class Routes:
    """The Responses routes of one fake engine, and the responses it made (`book`)."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.book = Book()

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)
        app.router.add_get("/v1/responses/{id}/input_items", self.input_items)

    def _not_found(self, response_id: str) -> web.Response:
        # vLLM's words and shape for an id its store does not hold.
        return error_response(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                              "response_id")

    def _headers(self) -> dict[str, str]:
        return {"X-Fake-Replica": self.engine.replica}

    async def create(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        body = await engine._gate(request)
        if isinstance(body, web.Response):
            return body
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self.book.get(previous) if isinstance(previous, str) else None
            if stored is None:
                return self._not_found(str(previous))
            history = stored.items
        try:
            items = input_items(body)
            chat = {"messages": chat_messages(body.get("instructions"), history + items),
                    "max_tokens": body.get("max_output_tokens"), "stream": body.get("stream", False)}
            gen = parse_generation(chat, "chat", model=engine.config.model, replica=engine.replica,
                                   natural=engine.config.default_max_tokens)
        except BadRequest as exc:
            return error_response(400, str(exc), "BadRequestError", exc.param)
        prompt = prompt_tokens_of(chat)
        response_id = f"resp_{uuid.uuid4().hex}"
        text = "".join(gen.tokens)
        whole = response_object(response_id, engine.config.model, body, text, "completed",
                                usage_of(gen.prompt_tokens, len(gen.tokens)))
        if body.get("store", True) is not False:
            output = whole["output"][0]
            self.book.put(Stored(whole, history + items + [output], items))
        if not gen.stream:
            async with engine.load.running(len(prompt) + len(gen.tokens)):
                await engine.load.prefill(prompt)
                await engine.load.whole(len(gen.tokens))
                engine.counters.account(gen)
            return web.json_response(whole, headers=self._headers())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **self._headers()})
        await response.prepare(request)
        events = Events(whole)
        try:
            async with engine.load.running(len(prompt) + len(gen.tokens)):
                await response.write(events.opening())
                await engine.load.prefill(prompt)
                await engine.load.first_token()
                async for due in engine.load.due(len(gen.tokens)):
                    await response.write(b"".join(events.delta(gen.tokens[i]) for i in due))
                await response.write(events.closing(text))
                engine.counters.account(gen)
        except ConnectionResetError:
            engine.counters.abort()
            return response
        await response.write_eof()
        return response

    async def retrieve(self, request: web.Request) -> web.Response:
        stored = self.book.get(request.match_info["id"])
        if stored is None:
            return self._not_found(request.match_info["id"])
        return web.json_response(stored.response, headers=self._headers())

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        if not self.book.delete(response_id):
            return self._not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True}, headers=self._headers())

    async def cancel(self, request: web.Request) -> web.Response:
        if self.book.get(request.match_info["id"]) is None:
            return self._not_found(request.match_info["id"])
        # vLLM's answer: only a background response can be cancelled, and the fake makes none.
        return error_response(400, "Cannot cancel a synchronous response.", "invalid_request_error")

    async def input_items(self, request: web.Request) -> web.Response:
        stored = self.book.get(request.match_info["id"])
        if stored is None:
            return self._not_found(request.match_info["id"])
        return web.json_response(page(stored.inputs), headers=self._headers())
