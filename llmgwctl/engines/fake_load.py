"""The fake engine behaving like an engine under load: slots, a prefix cache, and the time a reply takes.

`Load` is one engine's load model. `max_num_seqs` slots (`Slots`), the rest
queue; a prompt is looked up in an LRU prefix cache (`PrefixCache`) and only
its uncached tokens cost prefill time, one prefill at a time; a reply's
tokens come out paced by `--tokens-per-second`, or one per decode step whose
length grows with the batch of running requests. Every knob is off by
default (fake_config.py), which is the instant engine most tests rely on.

It knows nothing of HTTP: the server asks it when each token is due and
writes them itself.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from .fake_config import FakeConfig


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



class Load:
    """One engine's slots, prefix cache and the time its work takes (see the module's docstring)."""

    def __init__(self, config: FakeConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.slots = Slots(config.max_num_seqs)
        # Always counted (vLLM reports the families whenever prefix caching is
        # on, its default); with capacity 0 nothing is ever a hit.
        self.cache = PrefixCache(config.prefix_cache_tokens, config.block_size)
        self._prefill_lock = asyncio.Lock()
        self.running_tokens = 0     # prompt + reply tokens of the running requests: KV in use
        self.prefill_seconds = 0.0  # prefill time spent in all, for tests and benchmarks

    def kv_cache_usage(self) -> float:
        if self.config.prefix_cache_tokens > 0:
            # As vLLM counts it: blocks held by running requests, not the reusable cached ones.
            return min(1.0, self.running_tokens / self.config.prefix_cache_tokens)
        # Slots in use stand in for KV blocks in use: it rises and falls with load.
        return self.slots.running / self.slots.size

    @asynccontextmanager
    async def running(self, tokens: int) -> AsyncIterator[None]:
        """A slot (waiting for one if all are taken), holding `tokens` of KV until the block ends."""
        await self.slots.acquire()
        self.running_tokens += tokens
        try:
            yield
        finally:
            self.running_tokens -= tokens
            self.slots.release()

    async def prefill(self, prompt: list[str]) -> None:
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

    def decode_step(self) -> float:
        """Seconds one decode step takes now: longer as the batch of running requests grows."""
        extra = max(0, self.slots.running - 1) * self.config.batch_slowdown
        return self.config.decode_time_per_token * (1.0 + extra)

    async def first_token(self) -> None:
        """The wait for the first token once prefilled (--ttft)."""
        await sleep(self.config.ttft)

    async def whole(self, n_tokens: int) -> None:
        """The time a reply of `n_tokens` takes once prefilled, when it is sent whole."""
        if self.config.decode_time_per_token > 0:
            await self.first_token()
            for _ in range(n_tokens):
                await sleep(self.decode_step())
        elif self.config.tokens_per_second > 0:
            await sleep(self.config.ttft + n_tokens / self.config.tokens_per_second)
        else:
            await self.first_token()

    async def due(self, n_tokens: int) -> AsyncIterator[range]:
        """The indexes of a streamed reply's tokens, in the batches they fall due in.

        With a decode time, one token per decode step, whose length is read
        anew each step as the batch changes. Otherwise every token due by now
        at --tokens-per-second (all of them at once when it is 0), so a writer
        makes one write per batch: at high rates and many streams, one write
        per token would be the cost.
        """
        sent = 0
        if self.config.decode_time_per_token > 0:
            while sent < n_tokens:
                await sleep(self.decode_step())
                yield range(sent, sent + 1)
                sent += 1
            return
        start = self.clock()
        rate = self.config.tokens_per_second
        while sent < n_tokens:
            due = n_tokens if rate <= 0 else min(n_tokens, int((self.clock() - start) * rate) + 1)
            if due > sent:
                yield range(sent, due)
                sent = due
            else:
                await asyncio.sleep(start + sent / rate - self.clock())


async def sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)

