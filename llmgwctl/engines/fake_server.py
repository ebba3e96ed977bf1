"""The built-in fake engine: an aiohttp server that looks like vLLM from outside.

It is the GPU stand-in for every end-to-end test and benchmark, so what it owns
is *being indistinguishable on the wire* where llmgw looks: the OpenAI routes
(non-streaming and SSE streaming, in vLLM's exact chunk shapes; rerank, score
and tokenize as vLLM serves them, fake_scoring.py), Anthropic's Messages and
count_tokens as vLLM serves them (fake_messages.py), vLLM's error
shape, `/health` that stays 503 while "loading", and a `/metrics` page with
vLLM's real family names and labels that reflects its real in-flight state
(slots in use, requests queued beyond `--max-num-seqs`).

This module is the routes and the process; the rest is one module a concern:
its knobs (fake_config.py), the Responses API and its store (fake_responses.py), the load it behaves under -- slots, prefix cache,
pacing (fake_load.py) --, the /metrics page (fake_metrics.py), the reply
bodies and chunks (fake_replies.py), hostile answers (fake_faults.py), and
being a member of a replica spanning nodes (fake_group.py).

Replies are deterministic functions of the request plus this replica's
identity, so a test can tell which replica answered and that the body came
through intact. Failures injected with `--fail-rate` follow a request counter,
not a random generator, so a test run is reproducible.

It must not know about the rest of llmgw: it is an engine, launched by the
agent like any other, and nothing here imports another llmgwctl subpackage.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import signal
import struct
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from aiohttp import web

from .. import aio
from . import fake_faults, fake_group, fake_messages, fake_metrics, fake_responses, fake_scoring
from .fake_config import FakeConfig
from .fake_load import Load, prompt_tokens_of
from .fake_lora import AdapterError, FakeAdapters
from .fake_replies import (
    BadRequest,
    Chunks,
    Generation,
    count_prompt_tokens,
    embedding_vector,
    error_body,
    error_response,
    parse_generation,
)

__all__ = ["FakeConfig", "FakeEngine", "error_body", "error_response", "run", "serve", "start"]


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Compact like vLLM's pydantic output: fewer bytes per reply on the hot path.
_dumps = partial(json.dumps, separators=(",", ":"))


class FakeEngine:
    def __init__(self, config: FakeConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.replica = config.replica_id or str(config.port)
        self.started_at = clock()
        self.load = Load(config, clock)
        self.counters = fake_metrics.Counters()
        self.adapters = FakeAdapters(config.max_loras, config.max_adapters, config.lora_swap_time)
        self.requests_seen = 0
        self.created = int(time.time())
        # 503 to every request while on: flipped by SIGUSR1 in `serve` (fake_faults.Unavailable).
        self.unavailable = fake_faults.Unavailable()
        # The Responses API and the responses this process stored (fake_responses.py).
        self.responses = fake_responses.Routes(self)
        # The head of a group spanning nodes: its workers' rendezvous (fake_group.py); None on one node.
        self.rendezvous: fake_group.Rendezvous | None = None

    # -- state -------------------------------------------------------------

    def ready(self) -> bool:
        whole = self.rendezvous is None or self.rendezvous.whole
        return whole and self.clock() - self.started_at >= self.config.startup_delay

    def should_fail(self) -> bool:
        """Whether the next request gets an injected 500.

        Request n (1-based) fails when floor(n*rate) steps up: exactly `rate` of
        every run of requests fails, spread evenly, the same in every run.
        """
        self.requests_seen += 1
        n, rate = self.requests_seen, self.config.fail_rate
        return math.floor(n * rate) > math.floor((n - 1) * rate)

    def metrics_text(self) -> str:
        return fake_metrics.page(self.config.model, self.counters, self.load, self.adapters)

    # -- parsing -----------------------------------------------------------

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    # -- handlers ----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.rendezvous is not None and not self.rendezvous.whole:
            return web.Response(status=503, text=f"waiting for {self.rendezvous.waiting} worker(s) to join")
        if not self.ready():
            return web.Response(status=503, text="loading")
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.config.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.config.model, "parent": None, "max_model_len": self.config.max_model_len}
        cards = [card] + [{"id": name, "object": "model", "created": self.created, "owned_by": "vllm", "root": path,
                           "parent": self.config.model, "max_model_len": self.config.max_model_len}
                          for name, path in self.adapters.loaded.items()]
        return web.json_response({"object": "list", "data": cards}, dumps=_dumps)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime route (VLLM_ALLOW_RUNTIME_LORA_UPDATING): 200 with its text, or its error."""
        return await self._adapter_call(request, lambda b: self.adapters.load(b.get("lora_name"), b.get("lora_path")))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._adapter_call(request, lambda b: self.adapters.unload(b.get("lora_name")))

    async def _adapter_call(self, request: web.Request, call: Callable[[dict[str, Any]], str]) -> web.Response:
        try:
            body = await self.read_body(request)
            return web.Response(text=call(body))
        except BadRequest as exc:
            return error_response(400, str(exc), "BadRequestError")
        except AdapterError as exc:
            return error_response(exc.status, str(exc), "NotFoundError" if exc.status == 404 else "BadRequestError")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "text")

    async def _gate(self, request: web.Request, anthropic: bool = False) -> dict[str, Any] | web.Response:
        """Common checks: loading, body, model, injected failure. Returns the body, or the error to send.

        `anthropic`: errors in Anthropic's shape, as vLLM's Messages routes translate theirs.
        """
        def error(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
            if anthropic:
                return fake_messages.error_response(status, message, type_)
            return error_response(status, message, type_, param)

        if self.unavailable.on:
            return fake_faults.unavailable()
        if not self.ready():
            return error(503, "The engine is still loading the model.", "ServiceUnavailableError")
        try:
            body = await self.read_body(request)
        except BadRequest as exc:
            return error(400, str(exc), "BadRequestError", exc.param)
        model = body.get("model", self.config.model)
        if model != self.config.model and model not in self.adapters.loaded:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        if self.should_fail():
            return error(500, f"injected failure (--fail-rate {self.config.fail_rate})", "InternalServerError")
        return body

    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await self._gate(request)
        if isinstance(body, web.Response):
            return body
        # An adapter answers under its own name, so its reply differs from the base's.
        served = body.get("model", self.config.model)
        try:
            gen = parse_generation(body, kind, model=served, replica=self.replica,
                                   natural=self.config.default_max_tokens)
        except BadRequest as exc:
            return error_response(400, str(exc), "BadRequestError", exc.param)
        prompt = prompt_tokens_of(body)
        async with self._serving(served):
            if gen.stream:
                return await self._stream(request, gen, prompt, Chunks(gen, served))
            return await self._whole(gen, prompt, served)

    def _serving(self, served: str) -> contextlib.AbstractAsyncContextManager[object]:
        """An adapter's request counted as running on it (vLLM's lora_requests_info); the base's: nothing."""
        if served != self.config.model:
            return self.adapters.using(served)
        return contextlib.nullcontext()

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages, as vLLM serves it: the request made a chat one, the answer Anthropic's."""
        body = await self._gate(request, anthropic=True)
        if isinstance(body, web.Response):
            return body
        served = body.get("model", self.config.model)
        try:
            chat = fake_messages.as_chat(body)
            gen = parse_generation(chat, "chat", model=served, replica=self.replica,
                                   natural=self.config.default_max_tokens)
        except BadRequest as exc:
            return fake_messages.error_response(400, str(exc), "BadRequestError")
        prompt = prompt_tokens_of(chat)
        async with self._serving(served):
            if gen.stream:
                return await self._stream(request, gen, prompt, fake_messages.Events(gen, served))
            await self._generate(gen, prompt)
        return web.json_response(fake_messages.reply(gen, served),
                                 headers={"X-Fake-Replica": self.replica}, dumps=_dumps)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count_tokens: the prompt's tokens as a Messages request would count them."""
        body = await self._gate(request, anthropic=True)
        if isinstance(body, web.Response):
            return body
        try:
            chat = fake_messages.as_chat(body, counting=True)
            gen = parse_generation(chat, "chat", model=self.config.model, replica=self.replica, natural=0)
        except BadRequest as exc:
            return fake_messages.error_response(400, str(exc), "BadRequestError")
        return web.json_response({"input_tokens": gen.prompt_tokens}, headers={"X-Fake-Replica": self.replica},
                                 dumps=_dumps)

    async def _generate(self, gen: Generation, prompt: list[str]) -> None:
        """A whole (non-stream) generation's time and slot, counted as vLLM counts it."""
        async with self.load.running(len(prompt) + len(gen.tokens)):
            try:
                await self.load.prefill(prompt)
                await self.load.whole(len(gen.tokens))
                self.counters.account(gen)
            except asyncio.CancelledError:
                self.counters.abort()
                raise

    async def _whole(self, gen: Generation, prompt: list[str], served: str) -> web.Response:
        await self._generate(gen, prompt)
        text = "".join(gen.tokens)
        usage = self._usage(gen)
        if gen.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": gen.finish_reason, "stop_reason": None}
            reply: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason,
                      "stop_reason": None}
            reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
        reply.update(created=int(time.time()), model=served, choices=[choice], usage=usage)
        return web.json_response(reply, headers={"X-Fake-Replica": self.replica}, dumps=_dumps)

    async def _stream(self, request: web.Request, gen: Generation, prompt: list[str],
                      chunks: Chunks | fake_messages.Events) -> web.StreamResponse:
        # Headers go out before a slot is free, as vLLM's StreamingResponse does:
        # a queued stream is open (and counted as waiting) while it waits.
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", "X-Fake-Replica": self.replica})
        await response.prepare(request)
        done = False
        last = len(gen.tokens) - 1
        try:
            async with self.load.running(len(prompt) + len(gen.tokens)):
                await self.load.prefill(prompt)
                await self.load.first_token()
                await response.write(chunks.first())
                async for due in self.load.due(len(gen.tokens)):
                    await response.write(b"".join(chunks.token(i, last=(i == last)) for i in due))
                if not gen.tokens:
                    await response.write(chunks.empty_finish())
                await response.write(chunks.end(self._usage(gen)))
                done = True
                self.counters.account(gen)
        except ConnectionResetError:
            # The client went away between writes: count it as vLLM counts an
            # abort; the slot is freed as the block above ends.
            self.counters.abort()
            return response
        except asyncio.CancelledError:
            # Disconnect noticed by aiohttp itself (handler_cancellation).
            self.counters.abort()
            raise
        if done:
            await response.write_eof()
        return response

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._gate(request)
        if isinstance(body, web.Response):
            return body
        items = body.get("input")
        # OpenAI accepts a string, a list of strings, a token list, or a list of token lists.
        if isinstance(items, str) or (isinstance(items, list) and items and all(isinstance(x, int) for x in items)):
            items = [items]
        if not isinstance(items, list) or not items or not all(isinstance(x, (str, list)) for x in items):
            return error_response(400, "'input' must be a string, a list of strings, or token lists",
                                  "BadRequestError", "input")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            return error_response(400, f"'encoding_format' must be float or base64, got {fmt!r}",
                                  "BadRequestError", "encoding_format")
        data = []
        prompt_tokens = 0
        for i, item in enumerate(items):
            vec = embedding_vector(item, self.config.embedding_dim)
            if fmt == "base64":   # what the openai client asks for by default: float32 little-endian
                encoded: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            else:
                encoded = vec
            data.append({"index": i, "object": "embedding", "embedding": encoded})
            prompt_tokens += count_prompt_tokens(item) if isinstance(item, str) else max(1, len(item))
        self.counters.prompt_tokens_total += prompt_tokens
        return web.json_response({
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.config.model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None},
        }, headers={"X-Fake-Replica": self.replica}, dumps=_dumps)

    def scoring(self, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> _Handler:
        """A handler of rerank, score, tokenize or detokenize: the gate, then `answer` (fake_scoring.py)."""
        async def handle(request: web.Request) -> web.Response:
            body = await self._gate(request)
            if isinstance(body, web.Response):
                return body
            try:
                reply = answer(body)
            except BadRequest as exc:
                return error_response(400, str(exc), "BadRequestError", exc.param)
            return web.json_response(reply, headers={"X-Fake-Replica": self.replica}, dumps=_dumps)
        return handle

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's route of the same name (dev mode there): forget every cached block, for benchmarks."""
        self.load.cache.reset()
        return web.Response(status=200)

    # -- helpers -----------------------------------------------------------

    def _usage(self, gen: Generation) -> dict[str, Any]:
        n = len(gen.tokens)
        return {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens + n,
                "completion_tokens": n, "prompt_tokens_details": None}

    async def log_request(self, request: web.Request, response: web.StreamResponse) -> None:
        """What a test of a gateway's header policy reads: the request's headers that matter, as received."""
        h = request.headers
        rid = h.get("X-Request-Id")
        if rid is not None:
            response.headers["X-Request-Id"] = rid
        if request.method == "POST":
            print(f"fake engine {self.replica}: {request.method} {request.path} x-request-id={rid or '-'} "
                  f"traceparent={h.get('traceparent', '-')} tracestate={h.get('tracestate', '-')} "
                  f"authorization={'present' if 'Authorization' in h else 'absent'} "
                  f"cookie={'present' if 'Cookie' in h else 'absent'}", file=sys.stderr, flush=True)

    def app(self) -> web.Application:
        middlewares = [_not_found_as_openai_error] + ([_request_line] if self.config.log_requests else [])
        app = web.Application(middlewares=middlewares)
        if self.config.log_requests:
            app.on_response_prepare.append(self.log_request)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        # Reranking and scoring at every path vLLM serves them at, and its tokenizer's two routes.
        model, length = self.config.model, self.config.max_model_len
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self.scoring(lambda body: fake_scoring.rerank(body, model)))
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self.scoring(lambda body: fake_scoring.score(body, model)))
        app.router.add_post("/tokenize", self.scoring(lambda body: fake_scoring.tokenize(body, length)))
        app.router.add_post("/detokenize", self.scoring(fake_scoring.detokenize))
        self.responses.install(app)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        if self.adapters.enabled:
            # Only with LoRA on, as vLLM opens them only then (and only with
            # VLLM_ALLOW_RUNTIME_LORA_UPDATING).
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        fake_faults.install(app, self.config.fault, self.config.metrics_fault, self.config.redirect_to,
                            self.metrics_text)
        return app


@web.middleware
async def _not_found_as_openai_error(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(404, f"no route {request.path}", "NotFoundError")
    except web.HTTPMethodNotAllowed:
        return error_response(405, f"{request.method} is not allowed on {request.path}", "MethodNotAllowed")


@web.middleware
async def _request_line(request: web.Request, handler: _Handler) -> web.StreamResponse:
    resp = await handler(request)
    print(f"INFO {request.remote} \"{request.method} {request.path}\" {resp.status}", flush=True)
    return resp


async def start(config: FakeConfig, engine: FakeEngine | None = None) -> tuple[web.AppRunner, int]:
    """Start serving (`engine`, or one made of `config`); returns the runner (to clean up) and the bound port."""
    engine = engine or FakeEngine(config)
    # handler_cancellation: a client that disconnects cancels its handler at
    # once, so a waiting or paced stream frees its slot without waiting for its
    # next write to fail.
    runner = web.AppRunner(engine.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    if not config.replica_id:
        engine.replica = str(port)
    return runner, port


async def serve(config: FakeConfig, announce: Callable[[int], None] = lambda port: None) -> None:
    """Serve until SIGTERM or SIGINT; SIGUSR1 turns answering 503 to every request on and off.

    A worker of a group (`rank` > 0) serves nothing: it joins its head and
    lives until the head leaves. The head listens for its workers before it
    serves, and exits (fake_group.BROKEN_CODE) when its group breaks.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.group_size and config.rank:
        try:
            return await fake_group.serve_worker(config.group, config.rank, config.rendezvous,
                                                 config.join_timeout, stop)
        except fake_group.GroupBroken as exc:
            fake_group.exit_broken(str(exc))
    engine = FakeEngine(config)
    events = [stop]
    watch: asyncio.Task[None] | None = None
    if config.group_size:
        engine.rendezvous = fake_group.Rendezvous(config.group, config.group_size)
        await engine.rendezvous.start(config.host, fake_group.parse_address(config.rendezvous)[1])
        events.append(engine.rendezvous.broken)
        watch = asyncio.create_task(engine.rendezvous.watch(config.join_timeout))
    runner, port = await start(config, engine)
    announce(port)
    loop.add_signal_handler(signal.SIGUSR1, engine.unavailable.flip)
    try:
        # sleep_unless is False when the time ran out before a signal: the crash.
        crashed = not await aio.sleep_unless(config.crash_after, *events)
    finally:
        await aio.cancel_and_wait(*([watch] if watch else []))
        await runner.cleanup()
        if engine.rendezvous is not None:
            await engine.rendezvous.close()
    if engine.rendezvous is not None and engine.rendezvous.broken.is_set() and not stop.is_set():
        fake_group.exit_broken(engine.rendezvous.why)
    if crashed:
        # What vLLM prints when a model does not fit: the line an operator
        # looks for in `llmgwctl status` and `llmgwctl logs`.
        print(f"ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
              f"(simulated by --crash-after {config.crash_after:g})", flush=True)
        raise SystemExit(config.crash_code)


def run(config: FakeConfig, announce: Callable[[int], None] = lambda port: None) -> None:
    aio.run(serve(config, announce))
