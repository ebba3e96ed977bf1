"""The console's playground: a chat request sent through this process's router, its stream relayed back.

    POST /api/v1/playground/chat    {"model": NAME, "messages": [{"role", "content"}...],
                                     "max_tokens"?: N, "temperature"?: X}
        -> the router's answer as it comes (an SSE stream of chat chunks, the last with `usage`), or its
           error; the router's X-Request-Id (the page's own, when it sent a valid one) and
           x-llmgw-replica headers passed on.
        The API key, when the router wants one, comes in `X-Llmgw-Api-Key` and goes to the router as
        `Authorization: Bearer`.

Why a relay and not the page calling the router's port itself: the page is
served by the control API, so a call to the router would be another origin.
It would need the router to allow the console's origin (`--cors-origin`),
which then lets any script on that origin spend GPU time, and the page's
CSP to allow connecting elsewhere. Relayed, the page stays same-origin under
its CSP, the router stays closed to web pages, and the request is any
client's: it enters the router by its public port, so the key rules
(401 without a key when keys are on, 403 for a model the key may not use, its
rate), the routing, the metrics, the access log and the request log see it
as they see every other. Holding the admin token is not a way around them:
the admin token is never sent to the router, and with keys on the operator
types a key like any client.

Bounded: the body (MAX_BODY), messages, max_tokens (MAX_TOKENS), requests at
once (MAX_AT_ONCE), and how long the router may take to start answering.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from .answers import error

# A prompt typed into a page: 64 KB of JSON is pages of text.
MAX_BODY = 64 * 1024
MAX_MESSAGES = 64
# A playground answer is read by a person: 4,096 tokens is several pages.
MAX_TOKENS, DEFAULT_TOKENS = 4096, 256
# Playground requests in flight at once: a few operators' tabs, not a load generator.
MAX_AT_ONCE = 8
# The router waits up to its cold-start timeout for a replica (120 s by
# default) and keeps the stream alive meanwhile; the relay lets it, and gives
# up on a silence longer than that.
SILENCE = 180.0
_PASSED = ("X-Request-Id", "x-llmgw-replica", "x-llmgw-catalog-version", "Retry-After")


class Playground:
    """The relay; `router_url()` is the router's base URL in this process, None when there is none."""

    def __init__(self, router_url: Callable[[], str | None]):
        self.router_url = router_url
        self._session: aiohttp.ClientSession | None = None
        self.at_once = 0

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/api/v1/playground/chat", self.chat)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _body(self, raw: Any) -> dict[str, Any] | str:
        """The chat request to send, or why not."""
        if not isinstance(raw, dict):
            return 'the body must be {"model": NAME, "messages": [{"role": "user", "content": "..."}]}'
        model, messages = raw.get("model"), raw.get("messages")
        if not isinstance(model, str) or not model:
            return "model: the name of a model (or alias) of the catalog"
        if (not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in messages)):
            return f"messages: 1 to {MAX_MESSAGES} objects {{\"role\", \"content\"}} with text content"
        tokens = raw.get("max_tokens", DEFAULT_TOKENS)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
            return f"max_tokens: a whole number from 1 to {MAX_TOKENS}"
        body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": tokens,
                                "messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
        temperature = raw.get("temperature")
        if temperature is not None:
            if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
                return "temperature: a number from 0 to 2"
            body["temperature"] = temperature
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        base = self.router_url()
        if base is None:
            return error(501, "this controller runs no router of its own; send the prompt to a router "
                              "(llmgwctl router) directly", kind="not_implemented")
        data = await request.read()         # read, within the API's body timeout, by middleware.bodies
        if len(data) > MAX_BODY:
            return error(413, f"a playground request is at most {MAX_BODY} bytes", kind="invalid_request_error")
        try:
            raw = json.loads(data or b"null")
        except (ValueError, UnicodeDecodeError):
            return error(400, "the body must be JSON")
        body = self._body(raw)
        if isinstance(body, str):
            return error(400, body)
        if self.at_once >= MAX_AT_ONCE:
            return error(429, f"{MAX_AT_ONCE} playground requests are running already; wait for one to end",
                         kind="rate_limit_error")
        headers = {"Content-Type": "application/json"}
        # The page's request id, when it sent one, is the router's too (it takes a valid one as
        # any client's): what the page shows is what the request log and the access log say.
        rid = request.headers.get("X-Request-Id")
        if rid:
            headers["X-Request-Id"] = rid
        key = request.headers.get("X-Llmgw-Api-Key", "").strip()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if self._session is None:
            # No pooling of our own worth having: a person's prompts, one at a time.
            self._session = aiohttp.ClientSession(auto_decompress=False)
        self.at_once += 1
        resp: web.StreamResponse | None = None
        try:
            async with self._session.post(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                          headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=10,
                                                                        sock_read=SILENCE)) as upstream:
                passed = {h: upstream.headers[h] for h in _PASSED if h in upstream.headers}
                kind = upstream.headers.get("Content-Type", "application/json")
                resp = web.StreamResponse(status=upstream.status, headers={
                    "Content-Type": kind, "Cache-Control": "no-store", "X-Accel-Buffering": "no",
                    **passed})
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if resp is None:
                return error(502, f"the router at {base} did not answer: {exc.__class__.__name__}",
                             kind="upstream_error")
            return resp         # cut mid-stream: the page sees the stream end without its last event
        finally:
            self.at_once -= 1
