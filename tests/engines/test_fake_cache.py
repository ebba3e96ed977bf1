"""The fake engine's prefix cache, prefill and decode model, and their vLLM-style metrics."""
from __future__ import annotations

import asyncio

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from llmgwctl.engines import parse_load
from llmgwctl.engines.fake_config import FakeConfig
from llmgwctl.engines.fake_load import PrefixCache, prompt_tokens_of
from llmgwctl.engines.fake_server import FakeEngine

MODEL = "fake-cache"


def words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def counters(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=5).text):
        for sample in family.samples:
            out[sample.name] = sample.value
    return out


# -- the cache on its own ------------------------------------------------------------

def test_a_repeated_prompt_hits_its_full_blocks_and_counts_tokens_as_vllm_does():
    cache = PrefixCache(capacity_tokens=64, block_size=4)
    prompt = words(10)
    assert cache.lookup(prompt)[0] == 0
    cache.store(cache.lookup(prompt)[1])
    assert cache.lookup(prompt)[0] == 8                 # two full blocks; the partial third is never cached
    assert (cache.queries, cache.hits) == (30, 8)


def test_hits_stop_at_the_first_different_block_even_if_later_ones_are_equal():
    cache = PrefixCache(capacity_tokens=64, block_size=4)
    a = words(4, "a") + words(8, "s")
    cache.store(cache.lookup(a)[1])
    b = words(4, "b") + words(8, "s")                  # same tail, different first block
    assert cache.lookup(b)[0] == 0
    assert cache.lookup(words(4, "a") + words(4, "s") + words(4, "x"))[0] == 8


def test_the_lru_is_bounded_in_tokens_and_evicts_a_prompt_from_its_end():
    cache = PrefixCache(capacity_tokens=16, block_size=4)     # 4 blocks
    old, new = words(12, "o"), words(8, "n")
    cache.store(cache.lookup(old)[1])
    cache.store(cache.lookup(new)[1])
    assert len(cache) == 4
    assert cache.lookup(old)[0] == 8 and cache.lookup(new)[0] == 8   # old kept its first two blocks
    cache.reset()
    assert cache.lookup(old)[0] == 0


def test_no_capacity_means_no_hits_but_queries_still_count():
    cache = PrefixCache(capacity_tokens=0, block_size=16)
    prompt = words(40)
    cache.store(cache.lookup(prompt)[1])
    assert cache.lookup(prompt)[0] == 0 and cache.queries == 80 and cache.hits == 0


def test_chat_tokens_are_roles_and_contents_in_order():
    tokens = prompt_tokens_of({"messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": [{"type": "text", "text": "hi there"}]}]})
    assert tokens == ["<|system|>", "be", "brief", "<|user|>", "hi", "there"]
    assert prompt_tokens_of({"prompt": "a b c"}) == ["a", "b", "c"]


# -- the time model, in process ---------------------------------------------------------

def test_prefill_is_spent_on_uncached_tokens_only():
    async def run() -> float:
        engine = FakeEngine(FakeConfig(model=MODEL, prefix_cache_tokens=1000, block_size=4,
                                       prefill_time_per_token=0.0001))
        prompt = words(30)
        await engine.load.prefill(prompt)
        first = engine.load.prefill_seconds
        await engine.load.prefill(prompt)                  # 28 of 30 cached: 2 tokens to prefill
        return first, engine.load.prefill_seconds - first
    first, second = asyncio.run(run())
    assert first == pytest.approx(30 * 0.0001)
    assert second == pytest.approx(2 * 0.0001)


def test_a_decode_step_grows_with_the_batch():
    engine = FakeEngine(FakeConfig(model=MODEL, decode_time_per_token=0.01, batch_slowdown=0.1))
    engine.load.slots.running = 1
    assert engine.load.decode_step() == pytest.approx(0.01)
    engine.load.slots.running = 11
    assert engine.load.decode_step() == pytest.approx(0.02)


# -- as a process, configured on its command line -----------------------------------------

def test_cache_metrics_and_reset_through_the_command_line(fake_engine):
    engine = fake_engine(MODEL, "--prefix-cache-tokens", "4096", "--block-size", "4",
                         "--prefill-time-per-token", "0.0001", "--decode-time-per-token", "0.001",
                         "--batch-slowdown", "0.1")
    body = {"model": MODEL, "messages": [{"role": "system", "content": " ".join(words(40))},
                                         {"role": "user", "content": "question one"}], "max_tokens": 4}
    n_tokens = 1 + 40 + 1 + 2        # role markers count as tokens
    for stream in (False, True):
        r = requests.post(f"{engine.url}/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 200
    c = counters(engine.url)
    assert c["vllm:prefix_cache_queries_total"] == 2 * n_tokens
    assert c["vllm:prefix_cache_hits_total"] == (n_tokens // 4) * 4     # the second request's full blocks
    assert parse_load("fake", requests.get(f"{engine.url}/metrics", timeout=5).text).cache_tokens == 4096
    assert requests.post(f"{engine.url}/reset_prefix_cache", timeout=5).status_code == 200
    requests.post(f"{engine.url}/v1/chat/completions", json=body, timeout=30).raise_for_status()
    assert counters(engine.url)["vllm:prefix_cache_hits_total"] == (n_tokens // 4) * 4   # no new hit


def test_without_the_options_the_fake_reports_no_cache_size(fake_engine):
    engine = fake_engine(MODEL)
    requests.post(f"{engine.url}/v1/completions", json={"model": MODEL, "prompt": "a b c"}, timeout=10)
    assert parse_load("fake", requests.get(f"{engine.url}/metrics", timeout=5).text).cache_tokens is None
    c = counters(engine.url)
    assert c["vllm:prefix_cache_queries_total"] == 3 and c["vllm:prefix_cache_hits_total"] == 0
