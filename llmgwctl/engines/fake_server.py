"""The built-in fake engine: an aiohttp server that looks like vLLM from outside.

It is the GPU stand-in for every end-to-end test and benchmark, so what it owns
is *being indistinguishable on the wire* where llmgw looks: the OpenAI routes
(non-streaming and SSE streaming, in vLLM's exact chunk shapes), vLLM's error
shape, `/health` that stays 503 while "loading", and a `/metrics` page with
vLLM's real family names and labels that reflects its real in-flight state
(slots in use, requests queued beyond `--max-num-seqs`).

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
import json
import math
import signal
import struct
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable

from aiohttp import web

from .. import aio
from . import fake_faults
from .fake_replies import (BadRequest, Chunks, Generation, count_prompt_tokens, embedding_vector,
                           parse_generation)


@dataclass(frozen=True, slots=True)
class FakeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    # Empty means "the port": unique per replica on one host, and readable.
    replica_id: str = ""
    # 0: ready at once. Tests of health gating set a few seconds.
    startup_delay: float = 0.0
    # 0 = as fast as possible: tests want replies, not realism, unless they ask.
    tokens_per_second: float = 0.0
    ttft: float = 0.0
    # vLLM's long-standing default for max_num_seqs.
    max_num_seqs: int = 256
    fail_rate: float = 0.0
    # OpenAI's documented default for /v1/completions' max_tokens; also how long
    # a reply is when the client sets no limit (the "natural" end, finish=stop).
    default_max_tokens: int = 16
    # Small, because the vectors only need to be deterministic and distinct.
    embedding_dim: int = 16
    # A made-up context length reported in /v1/models, like vLLM's max_model_len.
    max_model_len: int = 4096
    # Seconds after start at which the engine prints a CUDA-out-of-memory
    # message and exits with `crash_code`, as a real engine that runs out of
    # GPU memory does; None: never. What tests of "why did it fail" crash on.
    crash_after: float | None = None
    # 3: any non-zero code that is not a signal; the message is what matters.
    crash_code: int = 3
    # One line on stdout per request (method, path, status), as vLLM's access
    # log does: what `llmgwctl logs -f` has to follow. Off: a benchmark's
    # engines should not spend time writing lines nobody reads.
    # Each request is also one stderr line naming the headers a gateway may
    # pass on, and X-Request-Id is echoed (vLLM's --enable-request-id-headers):
    # what a test of a gateway's header policy reads.
    log_requests: bool = False
    # -- behaving like an engine under load (PrefixCache, _prefill, _decode_step) --
    # Each default is 0 = off, which keeps the instant engine every test relies on.
    # Tokens the prefix cache holds (vLLM's KV cache size); 0: no cache, every
    # prompt token is prefilled.
    prefix_cache_tokens: int = 0
    # Tokens per cached block: vLLM's default --block-size. Only full blocks are cached.
    block_size: int = 16
    # Seconds per uncached prompt token. Prefills run one at a time (they are
    # compute-bound on one device), so a cold prompt also delays the prefills behind it.
    prefill_time_per_token: float = 0.0
    # Seconds per generated token for a batch of one; replaces --tokens-per-second when set.
    decode_time_per_token: float = 0.0
    # How much each further running request slows a decode step, as a share of
    # one request's step: 0.1 makes a batch of 11 decode at half speed.
    batch_slowdown: float = 0.0
    # -- misbehaving on purpose (fake_faults.py): None = off, the default --
    fault: str | None = None
    metrics_fault: str | None = None
    redirect_to: str = ""       # where the redirect modes send


# Compact like vLLM's pydantic output: fewer bytes per reply on the hot path.
_dumps = partial(json.dumps, separators=(",", ":"))


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    # vLLM's ErrorResponse: the OpenAI envelope with `code` set to the HTTP status.
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, type_, status, param), status=status, dumps=_dumps)


class Slots:
    """`max_num_seqs` slots; the rest queue. Running and waiting are what /metrics shows."""

    def __init__(self, size: int):
        self.size = size
        self.running = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(size)

    async def acquire(self) -> None:
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


class PrefixCache:
    """An LRU of prompt blocks, counted in tokens as vLLM counts its prefix cache.

    A prompt is its whitespace-separated words (the fake's tokens), cut into
    `block_size` blocks, each block's hash chained on the previous one as
    vLLM's block hashes are, so a block is a hit only when everything before
    it is too. A prompt's blocks are stored first block last, so eviction
    takes a prefix from its end, as the engine frees leaf blocks first.
    """

    def __init__(self, capacity_tokens: int, block_size: int):
        self.block_size = max(1, block_size)
        self.capacity = capacity_tokens // self.block_size     # in blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries = 0    # prompt tokens looked up, as vllm:prefix_cache_queries_total
        self.hits = 0       # of which found cached, as vllm:prefix_cache_hits_total

    def blocks(self, tokens: list[str]) -> list[int]:
        out, h, size = [], 0, self.block_size
        for i in range(0, len(tokens) - size + 1, size):
            h = hash((h, tuple(tokens[i:i + size])))
            out.append(h)
        return out

    def lookup(self, tokens: list[str]) -> tuple[int, list[int]]:
        """(how many leading tokens are cached, the prompt's block hashes); counts the query."""
        if self.capacity <= 0:
            self.queries += len(tokens)     # no cache: nothing to hash, nothing can hit
            return 0, []
        hashes = self.blocks(tokens)
        hit = 0
        for h in hashes:
            if h not in self._lru:
                break
            hit += 1
        cached = hit * self.block_size
        self.queries += len(tokens)
        self.hits += cached
        return cached, hashes

    def store(self, hashes: list[int]) -> None:
        if self.capacity <= 0:
            return
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def reset(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)


def prompt_tokens_of(body: dict[str, Any]) -> list[str]:
    """The prompt as the fake's tokens: chat messages as "role: content" in order, or the completion prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        words: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            words.append(f"<|{m.get('role')}|>")
            words.extend(str(content or "").split())
        return words
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt.split() if isinstance(prompt, str) else []


class FakeEngine:
    def __init__(self, config: FakeConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.replica = config.replica_id or str(config.port)
        self.started_at = clock()
        self.slots = Slots(config.max_num_seqs)
        self.requests_seen = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self.created = int(time.time())
        # Always counted (vLLM reports the families whenever prefix caching is
        # on, its default); with capacity 0 nothing is ever a hit.
        self.cache = PrefixCache(config.prefix_cache_tokens, config.block_size)
        self._prefill_lock = asyncio.Lock()
        self.running_tokens = 0     # prompt + reply tokens of the running requests: KV in use
        self.prefill_seconds = 0.0  # prefill time spent in all, for tests and benchmarks

    # -- state -------------------------------------------------------------

    def ready(self) -> bool:
        return self.clock() - self.started_at >= self.config.startup_delay

    def should_fail(self) -> bool:
        """Whether the next request gets an injected 500.

        Request n (1-based) fails when floor(n*rate) steps up: exactly `rate` of
        every run of requests fails, spread evenly, the same in every run.
        """
        self.requests_seen += 1
        n, rate = self.requests_seen, self.config.fail_rate
        return math.floor(n * rate) > math.floor((n - 1) * rate)

    def kv_cache_usage(self) -> float:
        if self.config.prefix_cache_tokens > 0:
            # As vLLM counts it: blocks held by running requests, not the reusable cached ones.
            return min(1.0, self.running_tokens / self.config.prefix_cache_tokens)
        # Slots in use stand in for KV blocks in use: it rises and falls with load.
        return self.slots.running / self.slots.size

    def metrics_text(self) -> str:
        labels = f'engine="0",model_name="{_escape_label(self.config.model)}"'
        lines = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for sample_name_and_labels, value in samples:
                lines.append(f"{sample_name_and_labels} {float(value)!r}")

        family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               [(f"vllm:num_requests_running{{{labels}}}", self.slots.running)])
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [(f"vllm:num_requests_waiting{{{labels}}}", self.slots.waiting)])
        family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [(f"vllm:kv_cache_usage_perc{{{labels}}}", self.kv_cache_usage())])
        family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               [(f"vllm:prompt_tokens_total{{{labels}}}", self.prompt_tokens_total)])
        family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               [(f"vllm:generation_tokens_total{{{labels}}}", self.generation_tokens_total)])
        family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
               [(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                 f'model_name="{_escape_label(self.config.model)}"}}', count)
                for reason, count in self.finished.items()])
        family("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               [(f"vllm:prefix_cache_queries_total{{{labels}}}", self.cache.queries)])
        family("vllm:prefix_cache_hits_total", "counter",
               "Prefix cache hits, in terms of number of cached tokens.",
               [(f"vllm:prefix_cache_hits_total{{{labels}}}", self.cache.hits)])
        if self.config.prefix_cache_tokens > 0:
            # Only with a cache: its size is what a router's prefix index sizes itself by.
            blocks = self.config.prefix_cache_tokens // self.cache.block_size
            family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
                   [(f'vllm:cache_config_info{{block_size="{self.cache.block_size}",enable_prefix_caching="True",'
                     f'engine="0",num_gpu_blocks="{blocks}"}}', 1)])
        return "\n".join(lines) + "\n"

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

    def check_model(self, body: dict[str, Any]) -> web.Response | None:
        model = body.get("model", self.config.model)
        if model != self.config.model:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return None

    # -- handlers ----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready():
            return web.Response(status=503, text="loading")
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.config.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.config.model, "parent": None, "max_model_len": self.config.max_model_len}
        return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "text")

    async def _gate(self, request: web.Request) -> dict[str, Any] | web.Response:
        """Common checks: loading, body, model, injected failure. Returns the body, or the error to send."""
        if not self.ready():
            return error_response(503, "The engine is still loading the model.", "ServiceUnavailableError")
        try:
            body = await self.read_body(request)
        except BadRequest as exc:
            return error_response(400, str(exc), "BadRequestError", exc.param)
        wrong = self.check_model(body)
        if wrong is not None:
            return wrong
        if self.should_fail():
            return error_response(500, f"injected failure (--fail-rate {self.config.fail_rate})",
                                  "InternalServerError")
        return body

    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await self._gate(request)
        if isinstance(body, web.Response):
            return body
        try:
            gen = parse_generation(body, kind, model=self.config.model, replica=self.replica,
                                   natural=self.config.default_max_tokens)
        except BadRequest as exc:
            return error_response(400, str(exc), "BadRequestError", exc.param)
        prompt = prompt_tokens_of(body)
        if gen.stream:
            return await self._stream(request, gen, prompt)
        return await self._whole(gen, prompt)

    async def _whole(self, gen: Generation, prompt: list[str]) -> web.Response:
        await self.slots.acquire()
        held = len(prompt) + len(gen.tokens)
        self.running_tokens += held
        try:
            await self._prefill(prompt)
            if self.config.decode_time_per_token > 0:
                await self._sleep(self.config.ttft)
                for _ in gen.tokens:
                    await self._sleep(self._decode_step())
            else:
                await self._pace(len(gen.tokens))
            self._account(gen, finished=True)
        except asyncio.CancelledError:
            self.finished["abort"] += 1
            raise
        finally:
            self.running_tokens -= held
            self.slots.release()
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
        reply.update(created=int(time.time()), model=self.config.model, choices=[choice], usage=usage)
        return web.json_response(reply, headers={"X-Fake-Replica": self.replica}, dumps=_dumps)

    async def _stream(self, request: web.Request, gen: Generation, prompt: list[str]) -> web.StreamResponse:
        # Headers go out before a slot is free, as vLLM's StreamingResponse does:
        # a queued stream is open (and counted as waiting) while it waits.
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", "X-Fake-Replica": self.replica})
        await response.prepare(request)
        chunks = Chunks(gen, self.config.model)
        acquired = False
        done = False
        held = len(prompt) + len(gen.tokens)
        try:
            await self.slots.acquire()
            acquired = True
            self.running_tokens += held
            await self._prefill(prompt)
            await self._sleep(self.config.ttft)
            await response.write(chunks.first())
            sent = 0
            start = self.clock()
            rate = self.config.tokens_per_second
            if self.config.decode_time_per_token > 0:
                # The batch-dependent model: one token per decode step, whose
                # length is read anew each step as the batch changes.
                while sent < len(gen.tokens):
                    await self._sleep(self._decode_step())
                    await response.write(chunks.token(sent, last=(sent == len(gen.tokens) - 1)))
                    sent += 1
            while sent < len(gen.tokens):
                # Write every token that is due by now in one write: at high
                # rates and many streams, one write per token would be the cost.
                due = len(gen.tokens) if rate <= 0 else min(len(gen.tokens), int((self.clock() - start) * rate) + 1)
                if due > sent:
                    await response.write(b"".join(chunks.token(i, last=(i == len(gen.tokens) - 1))
                                                  for i in range(sent, due)))
                    sent = due
                else:
                    await asyncio.sleep(start + sent / rate - self.clock())
            if not gen.tokens:
                await response.write(chunks.empty_finish())
            if gen.include_usage:
                await response.write(chunks.usage(self._usage(gen)))
            await response.write(b"data: [DONE]\n\n")
            done = True
            self._account(gen, finished=True)
        except ConnectionResetError:
            # The client went away between writes: count it as vLLM counts an
            # abort; the slot is freed below.
            self.finished["abort"] += 1
            return response
        except asyncio.CancelledError:
            # Disconnect noticed by aiohttp itself (handler_cancellation).
            self.finished["abort"] += 1
            raise
        finally:
            if acquired:
                self.running_tokens -= held
                self.slots.release()
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
        self.prompt_tokens_total += prompt_tokens
        return web.json_response({
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.config.model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None},
        }, headers={"X-Fake-Replica": self.replica}, dumps=_dumps)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's route of the same name (dev mode there): forget every cached block, for benchmarks."""
        self.cache.reset()
        return web.Response(status=200)

    # -- helpers -----------------------------------------------------------

    async def _prefill(self, prompt: list[str]) -> None:
        """Look the prompt up in the prefix cache and spend the prefill time of what missed; then cache it.

        Without a prefill time this only counts and stores: no sleep, no lock.
        """
        per_token = self.config.prefill_time_per_token
        if per_token <= 0:
            self.cache.store(self.cache.lookup(prompt)[1])
            return
        # One prefill at a time: a cold prompt occupies the device and delays
        # the prefills queued behind it, as on a real engine. The lookup is
        # made when this prefill's turn comes, so a request queued behind one
        # with the same prefix finds it cached, as a vLLM scheduler step would.
        async with self._prefill_lock:
            cached, hashes = self.cache.lookup(prompt)
            seconds = (len(prompt) - cached) * per_token
            if seconds > 0:
                await asyncio.sleep(seconds)
            self.cache.store(hashes)
        self.prefill_seconds += seconds

    def _decode_step(self) -> float:
        """Seconds one decode step takes now: longer as the batch of running requests grows."""
        extra = max(0, self.slots.running - 1) * self.config.batch_slowdown
        return self.config.decode_time_per_token * (1.0 + extra)

    async def _pace(self, n_tokens: int) -> None:
        delay = self.config.ttft
        if self.config.tokens_per_second > 0:
            delay += n_tokens / self.config.tokens_per_second
        await self._sleep(delay)

    @staticmethod
    async def _sleep(seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    def _usage(self, gen: Generation) -> dict[str, Any]:
        n = len(gen.tokens)
        return {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens + n,
                "completion_tokens": n, "prompt_tokens_details": None}

    def _account(self, gen: Generation, finished: bool) -> None:
        self.prompt_tokens_total += gen.prompt_tokens
        self.generation_tokens_total += len(gen.tokens)
        if finished:
            self.finished[gen.finish_reason] += 1

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
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        fake_faults.install(app, self.config.fault, self.config.metrics_fault, self.config.redirect_to,
                            self.metrics_text)
        return app


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@web.middleware
async def _not_found_as_openai_error(request: web.Request, handler: Callable[[web.Request], Awaitable]):
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(404, f"no route {request.path}", "NotFoundError")
    except web.HTTPMethodNotAllowed:
        return error_response(405, f"{request.method} is not allowed on {request.path}", "MethodNotAllowed")


@web.middleware
async def _request_line(request: web.Request, handler: Callable[[web.Request], Awaitable]):
    resp = await handler(request)
    print(f"INFO {request.remote} \"{request.method} {request.path}\" {resp.status}", flush=True)
    return resp


async def start(config: FakeConfig) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (to clean up) and the bound port."""
    engine = FakeEngine(config)
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
    """Serve until SIGTERM or SIGINT."""
    runner, port = await start(config)
    announce(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        # sleep_unless is False when the time ran out before a signal: the crash.
        crashed = not await aio.sleep_unless(config.crash_after, stop)
    finally:
        await runner.cleanup()
    if crashed:
        # What vLLM prints when a model does not fit: the line an operator
        # looks for in `llmgwctl status` and `llmgwctl logs`.
        print(f"ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
              f"(simulated by --crash-after {config.crash_after:g})", flush=True)
        raise SystemExit(config.crash_code)


def run(config: FakeConfig, announce: Callable[[int], None] = lambda port: None) -> None:
    aio.run(serve(config, announce))
