"""The fake engine's `/metrics` page: vLLM's family names and labels, from its real in-flight state.

What a router's load poller reads from a vLLM engine, so the fake is
indistinguishable where llmgw looks: requests running and waiting (the
slots), KV-cache use, token and request counters, prefix-cache queries and
hits, and the cache's size once there is a cache. `Counters` is what the
server counts as requests end; `page()` renders it with the load's state.
"""
from __future__ import annotations

import time

from .fake_load import Load
from .fake_lora import FakeAdapters
from .fake_replies import Generation


class Counters:
    """Tokens and finished requests as vLLM counts them (`*_total`, `request_success_total` by reason)."""

    def __init__(self) -> None:
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished = {"stop": 0, "length": 0, "abort": 0}

    def account(self, gen: Generation) -> None:
        """A generation that ran to its end."""
        self.prompt_tokens_total += gen.prompt_tokens
        self.generation_tokens_total += len(gen.tokens)
        self.finished[gen.finish_reason] += 1

    def abort(self) -> None:
        """A generation whose client went away first, as vLLM counts an abort."""
        self.finished["abort"] += 1


def page(model: str, counters: Counters, load: Load, adapters: FakeAdapters | None = None) -> str:
    labels = f'engine="0",model_name="{_escape_label(model)}"'
    lines = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for sample_name_and_labels, value in samples:
            lines.append(f"{sample_name_and_labels} {float(value)!r}")

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           [(f"vllm:num_requests_running{{{labels}}}", load.slots.running)])
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           [(f"vllm:num_requests_waiting{{{labels}}}", load.slots.waiting)])
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [(f"vllm:kv_cache_usage_perc{{{labels}}}", load.kv_cache_usage())])
    family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           [(f"vllm:prompt_tokens_total{{{labels}}}", counters.prompt_tokens_total)])
    family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           [(f"vllm:generation_tokens_total{{{labels}}}", counters.generation_tokens_total)])
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
           [(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
             f'model_name="{_escape_label(model)}"}}', count)
            for reason, count in counters.finished.items()])
    family("vllm:prefix_cache_queries_total", "counter",
           "Prefix cache queries, in terms of number of queried tokens.",
           [(f"vllm:prefix_cache_queries_total{{{labels}}}", load.cache.queries)])
    family("vllm:prefix_cache_hits_total", "counter",
           "Prefix cache hits, in terms of number of cached tokens.",
           [(f"vllm:prefix_cache_hits_total{{{labels}}}", load.cache.hits)])
    if load.config.prefix_cache_tokens > 0:
        # Only with a cache: its size is what a router's prefix index sizes itself by.
        blocks = load.config.prefix_cache_tokens // load.cache.block_size
        family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
               [(f'vllm:cache_config_info{{block_size="{load.cache.block_size}",enable_prefix_caching="True",'
                 f'engine="0",num_gpu_blocks="{blocks}"}}', 1)])
    if adapters is not None and adapters.enabled:
        # vLLM's info gauge (its value the time of the reading): the adapters
        # running and waiting now, and the slots. What a scheduler scores
        # adapter affinity from.
        running = ",".join(sorted(adapters.running))
        waiting = ",".join(sorted(adapters.waiting))
        family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
               [(f'vllm:lora_requests_info{{max_lora="{adapters.slots}",running_lora_adapters="{_escape_label(running)}",'
                 f'waiting_lora_adapters="{_escape_label(waiting)}"}}', time.time())])
        family("fake_lora_slot_hits_total", "counter", "Adapter requests whose adapter was in a slot.",
               [("fake_lora_slot_hits_total", adapters.hits)])
        family("fake_lora_slot_misses_total", "counter", "Adapter requests that swapped their adapter in.",
               [("fake_lora_slot_misses_total", adapters.misses)])
    return "\n".join(lines) + "\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
