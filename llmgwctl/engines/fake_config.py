"""`FakeConfig`: the fake engine's knobs, each default once with its reason.

Kept apart from the server so the CLI can read the defaults without loading
aiohttp. Grouped by the concern that reads them: serving (fake_server.py),
behaving like an engine under load (fake_load.py), misbehaving on purpose
(`fail_rate` and the crash in fake_server.py, the rest in fake_faults.py), a member of a
group spanning nodes (fake_group.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FakeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    # Empty means "the port": unique per replica on one host, and readable.
    replica_id: str = ""
    # 0: ready at once. Tests of health gating set a few seconds.
    startup_delay: float = 0.0
    # vLLM's long-standing default for max_num_seqs.
    max_num_seqs: int = 256
    # OpenAI's documented default for /v1/completions' max_tokens; also how long
    # a reply is when the client sets no limit (the "natural" end, finish=stop).
    default_max_tokens: int = 16
    # Small, because the vectors only need to be deterministic and distinct.
    embedding_dim: int = 16
    # A made-up context length reported in /v1/models, like vLLM's max_model_len.
    max_model_len: int = 4096
    # One line on stdout per request (method, path, status), as vLLM's access
    # log does: what `llmgwctl logs -f` has to follow. Off: a benchmark's
    # engines should not spend time writing lines nobody reads.
    # Each request is also one stderr line naming the headers a gateway may
    # pass on, and X-Request-Id is echoed (vLLM's --enable-request-id-headers):
    # what a test of a gateway's header policy reads.
    log_requests: bool = False
    # -- behaving like an engine under load (fake_load.py) --
    # Each default is 0 = off, which keeps the instant engine every test relies on.
    # As fast as possible: tests want replies, not realism, unless they ask.
    tokens_per_second: float = 0.0
    ttft: float = 0.0
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
    # -- LoRA adapters (fake_lora.py) --
    # Adapter slots, as vLLM's --max-loras; 0: LoRA off, as vLLM without --enable-lora.
    max_loras: int = 0
    # Adapters it may hold loaded at once; 0: no bound of its own (vLLM evicts instead).
    max_adapters: int = 0
    # Seconds an adapter not in a slot takes to swap in; 0: instant.
    lora_swap_time: float = 0.0
    # -- a member of a replica spanning nodes (fake_group.py); group_size 0: not a member --
    group: str = ""
    rank: int = 0               # 0: the head, which serves; 1 ..: workers, which only join it
    group_size: int = 0
    rendezvous: str = ""        # HOST:PORT: where workers reach the head; the head listens on PORT at --host
    # How long a member waits for its group to form before it exits: a
    # worker's agent may hear of its start a long-poll after the head's, and
    # a cold Python start on a loaded machine takes seconds.
    join_timeout: float = 120.0
    # -- misbehaving on purpose: 0 or None = off, the default --
    # Share of requests answered 500, by a request counter (FakeEngine.should_fail).
    fail_rate: float = 0.0
    # Seconds after start at which the engine prints a CUDA-out-of-memory
    # message and exits with `crash_code`, as a real engine that runs out of
    # GPU memory does; None: never. What tests of "why did it fail" crash on.
    crash_after: float | None = None
    # 3: any non-zero code that is not a signal; the message is what matters.
    crash_code: int = 3
    # A hostile engine's answers and /metrics pages (fake_faults.py).
    fault: str | None = None
    metrics_fault: str | None = None
    redirect_to: str = ""       # where the redirect modes send
