"""The `prefix` policy: the replica most likely to hold the prompt's prefix in its engine's cache, weighed against load.

Owns, per model, an approximate index of which endpoint recently served which
prompt prefixes, and the cost model's pick (`CostPick`), which the `session`
policy (session.py) reuses with one block standing for a whole session.
It must not know about HTTP or the catalog: the registry hands it the parsed
body and the route's way of reading the prompt.

Why it pays. An engine with a prefix cache (vLLM's automatic prefix caching,
SGLang's radix cache) skips the prefill of every prompt block it has seen:
on this project's vLLM CPU a 1,721-token prompt took 10 s cold and 0.2-0.5 s
with its prefix cached. A pick by load alone scatters requests that share a
system prompt or a chat history over every replica, so each replica pays
the cold prefill once per prefix and keeps N copies of the same blocks.

The index. The prompt as the engine will see it -- chat messages in order,
role and content each, or a completion's prompt text -- is cut into blocks of
`BLOCK_CHARS` characters, each block's hash chained on the previous one, so
block i's hash stands for the whole prefix up to it (as vLLM's block hashes
do). Characters stand in for tokens: the router has no tokenizer (the
model's own would cost milliseconds per request, a hundred times the
budget), BPE tokenizers average about four characters a token on English
and code, and only the *length* of a shared prefix is estimated, so block
edges need not line up with the engine's. Each endpoint keeps the hashes it
was sent in a bounded LRU sized from its engine's KV cache when its metrics
say (vLLM's `cache_config_info`), else `DEFAULT_CACHE_TOKENS`. A prompt's
blocks are recorded first block last, so the LRU evicts a prefix from its
end, the way the engine's cache does, and a lookup can binary-search the
match length.

Hashing: Python's own `hash()` of (previous, block) -- SipHash in C, about
6 us for a 2,000-token prompt against 25 us for hashlib.blake2b, and no new
dependency. It is seeded per process, which is fine because the index never
leaves the process: each router learns from its own traffic (see below).
The seed also keeps a client from crafting colliding prompts.

The pick (`CostPick.choose`) is a cost model, expected time to first token
in units of "one more request ahead":

    cost(e) = load(e) + uncached_tokens(e) / (TOKENS_PER_REQUEST * weight(e))

where load is the balancer's own score (requests running and queued per
unit of weight). A hot prefix stays on the replica that holds it until that
replica carries more requests than the prefill it would save is worth, then
spreads to a second one (which then learns it too). A replica with no room
(requests queued, KV cache full) is not a candidate at all: the balancer
filters by room before any chooser sees the tier. With no cached block
anywhere the pick is least-load's own (two random choices), so prompts
without reuse are routed exactly as before.

Robust to change: a new replica (or one restarted under a new URL, which is
a new `EndpointState`) starts with an empty index; one that leaves the list
drops its index on the next pick after the change. Several routers each
learn from their own traffic: with R routers behind a load balancer, a
prefix is learnt up to R times, so it may be prefilled once per router on
up to R replicas before every router sends it to one that holds it. The
cost is at most R-1 extra cold prefills per prefix per replica set, paid
once, and a hit rate that converges a little slower; it needs no shared
state on the request path.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ..balancer import Balancer, EndpointState
from .plugin import PromptReader, Settings

# 256 characters is about 64 tokens: four of vLLM's 16-token blocks, so a
# 2,000-token prompt is ~31 hashes (6 us) and a shared prefix is located to
# within ~64 tokens, a few percent of a system prompt worth caching.
BLOCK_CHARS = 256
# BPE tokenizers (Llama, Qwen, GPT) average about 4 characters a token on
# English text and code; used only to turn characters into a token estimate.
CHARS_PER_TOKEN = 4.0
# Without a reading of the engine's cache size: 100,000 tokens is a 24-80 GB
# GPU's KV cache for a 7-8B model with grouped-query attention, and the
# index entries it bounds cost ~100 bytes each (1,600 blocks per endpoint).
DEFAULT_CACHE_TOKENS = 100_000
# Hash at most this many blocks (~32,000 tokens): a longer shared prefix is
# still found, and a 1 MB prompt cannot make the router hash 1 MB per request.
MAX_BLOCKS = 512
# How many uncached prompt tokens cost as much time to first token as one
# more request ahead in the engine. On this project's vLLM CPU a 1,721-token
# cold prefill took 10 s against 0.2-0.5 s cached, several times a short
# request's whole life; on GPUs prefill is faster but so is decode, so the
# ratio moves less than either. In bench/routing.py 256 kept the hit rate
# near its ceiling where 512 and 1,024 let hot prefixes spread too early
# (hit rate 0.71 and 0.55 against 0.77, TTFT p50 0.07x and 0.73x of round
# robin against 0.06x), while a replica with requests queued still drops out.
TOKENS_PER_REQUEST = 256.0


def prompt_text(doc: Mapping[str, Any]) -> str | None:
    """A chat's or a completion's prompt, whichever the body holds (see `chat_prompt`, `completion_prompt`)."""
    if type(doc.get("messages")) is list:
        return chat_prompt(doc)
    return completion_prompt(doc)


def chat_prompt(doc: Mapping[str, Any]) -> str | None:
    """A chat's prompt roughly as the engine's chat template lays it out; None when there is none to hash.

    Roles and contents in order, separated as templates separate them: close
    enough that two requests sharing leading messages share a leading string.
    Only the first MAX_BLOCKS blocks' worth is kept.
    """
    limit = MAX_BLOCKS * BLOCK_CHARS
    messages = doc.get("messages")
    if type(messages) is not list:
        return None
    parts: list[str] = []
    size = 0
    for m in messages:
        if type(m) is not dict:
            return None
        content = m.get("content")
        if type(content) is list:   # content parts: only the text ones reach the template as text
            content = "".join(p.get("text", "") for p in content
                              if type(p) is dict and type(p.get("text")) is str)
        elif type(content) is not str:
            content = ""
        role = m.get("role")
        part = f"<|{role if type(role) is str else ''}|>\n{content}\n"
        parts.append(part)
        size += len(part)
        if size >= limit:
            break
    return "".join(parts)[:limit]


def responses_prompt(doc: Mapping[str, Any]) -> str | None:
    """A Responses request's prompt as a chat's: `instructions` as the system message, then `input`.

    `input` is a string (one user message) or a list of items; a message
    item's content is a string or parts whose `text` the template lays out
    (input_text, output_text). Other items (tool calls, their outputs) add
    their type only: they are rare before the last turn, and a request
    continuing a stored response (`previous_response_id`) goes to its
    replica, whatever its prompt. None when there is neither.
    """
    messages: list[Any] = []
    instructions = doc.get("instructions")
    if type(instructions) is str:
        messages.append({"role": "system", "content": instructions})
    given = doc.get("input")
    if type(given) is str:
        messages.append({"role": "user", "content": given})
    elif type(given) is list:
        for item in given:
            if type(item) is not dict:
                return None
            if "role" in item:
                messages.append(item)
            else:
                messages.append({"role": str(item.get("type", "")), "content": ""})
    if not messages:
        return None
    return chat_prompt({"messages": messages})


def messages_prompt(doc: Mapping[str, Any]) -> str | None:
    """An Anthropic Messages request's prompt: `system` (a string or text blocks), then the messages as a chat's.

    The engine's template puts the system prompt first, as one system
    message (vLLM joins the blocks), so requests sharing a system prompt
    share a leading string here too. Content blocks count by their text;
    images and tool results add nothing, as in `chat_prompt`.
    """
    limit = MAX_BLOCKS * BLOCK_CHARS
    system = doc.get("system")
    if type(system) is list:
        system = "".join(b.get("text", "") for b in system if type(b) is dict and type(b.get("text")) is str)
    head = f"<|system|>\n{system}\n" if type(system) is str and system else ""
    if len(head) >= limit:
        return head[:limit]
    chat = chat_prompt(doc)
    if chat is None:
        return head[:limit] if head else None
    return (head + chat)[:limit]


def completion_prompt(doc: Mapping[str, Any]) -> str | None:
    """A completion's prompt text (one string, or a list of one); None for token ids or a batch."""
    prompt = doc.get("prompt")
    if type(prompt) is list and len(prompt) == 1:
        prompt = prompt[0]
    if type(prompt) is str:
        return prompt[:MAX_BLOCKS * BLOCK_CHARS]
    return None


def block_hashes(text: str, block: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of `text`'s full blocks: element i stands for text[:(i+1)*block].

    A partial last block is left out: engines cache only full blocks.
    """
    out = []
    h = 0
    for i in range(0, len(text) - block + 1, block):
        h = hash((h, text[i:i + block]))
        out.append(h)
    return out


class EndpointIndex:
    """One endpoint's recently sent prefix blocks: a bounded LRU of block hashes."""

    __slots__ = ("capacity", "_lru")

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` this endpoint holds.

        Binary search: the blocks of a prefix are recorded together and
        evicted from the end, so what is held is a prefix of the chain.
        """
        lru = self._lru
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if hashes[mid - 1] in lru:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def record(self, hashes: Sequence[int]) -> None:
        """The endpoint was sent this prompt: its blocks are the most recent, the first block most of all."""
        lru = self._lru
        move = lru.move_to_end
        for h in reversed(hashes):
            if h in lru:
                move(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


def capacity_blocks(st: EndpointState, block: int = BLOCK_CHARS) -> int:
    """How many blocks to index for `st`: its engine's KV cache size when its metrics say, else the default."""
    load = st.load
    tokens = (load.cache_tokens if load is not None else None) or DEFAULT_CACHE_TOKENS
    return max(1, int(tokens * CHARS_PER_TOKEN / block))


class ModelIndex:
    """Every endpoint's `EndpointIndex` for one model, keyed by the endpoint's state object.

    Keyed by the object, not the replica id: a replica restarted under a new
    URL gets a new `EndpointState` from the balancer, and with it an empty
    index, which is what its engine's empty cache holds.
    """

    __slots__ = ("block", "_by_state")

    def __init__(self, block: int = BLOCK_CHARS):
        self.block = block
        self._by_state: dict[EndpointState, EndpointIndex] = {}

    def get(self, st: EndpointState) -> EndpointIndex | None:
        return self._by_state.get(st)

    def of(self, st: EndpointState) -> EndpointIndex:
        idx = self._by_state.get(st)
        if idx is None:
            idx = self._by_state[st] = EndpointIndex(capacity_blocks(st, self.block))
        return idx

    def retain(self, alive: set[EndpointState]) -> None:
        for st in [s for s in self._by_state if s not in alive]:
            del self._by_state[st]

    def __len__(self) -> int:
        return len(self._by_state)


class CostPick:
    """One request's pick by the cost model in the module docstring; records the prompt on the endpoint chosen."""

    __slots__ = ("_balancer", "_index", "_hashes", "_block_tokens", "_tokens", "_per_request")

    def __init__(self, balancer: Balancer, index: ModelIndex, hashes: list[int], block_tokens: float,
                 tokens: float, per_request: float):
        self._balancer = balancer
        self._index = index
        self._hashes = hashes
        self._block_tokens = block_tokens     # tokens one hash stands for
        self._tokens = tokens                 # the prompt's estimated length in tokens
        self._per_request = per_request

    def choose(self, cands: Sequence[EndpointState], now: float) -> EndpointState:
        balancer, index, hashes = self._balancer, self._index, self._hashes
        best: EndpointState | None = None
        if len(cands) > 1:
            matches = []
            any_match = False
            for st in cands:
                idx = index.get(st)
                m = idx.match(hashes) if idx is not None else 0
                matches.append(m)
                any_match = any_match or m > 0
            if any_match:
                best_cost = float("inf")
                ties = 0
                rand = balancer.random
                tokens, per_block, per_request = self._tokens, self._block_tokens, self._per_request
                for st, m in zip(cands, matches):
                    uncached = max(0.0, tokens - m * per_block)
                    cost = balancer.score(st, now) + uncached / (per_request * st.weight)
                    if cost < best_cost:
                        best, best_cost, ties = st, cost, 1
                    elif cost == best_cost:
                        # Equal cost: an even random choice among the tied (reservoir of one).
                        ties += 1
                        if rand() * ties < 1.0:
                            best = st
        if best is None:
            # Nothing cached anywhere (or one candidate): least-load's own pick.
            best = balancer.two_choices(list(cands), now)
        index.of(best).record(hashes)
        return best


class Indexes:
    """A `ModelIndex` per model, as the prefix and session plugins each keep one."""

    __slots__ = ("block", "_by_model")

    def __init__(self, block: int = BLOCK_CHARS):
        self.block = block
        self._by_model: dict[str, ModelIndex] = {}

    def of(self, model: str) -> ModelIndex:
        idx = self._by_model.get(model)
        if idx is None:
            idx = self._by_model[model] = ModelIndex(self.block)
        return idx

    def retain(self, alive: set[EndpointState]) -> None:
        """Drop the indexes of endpoints not in `alive`, and the models left with none."""
        for model, idx in list(self._by_model.items()):
            idx.retain(alive)
            if not len(idx):
                del self._by_model[model]


class Prefix:
    """The plugin: every model's index, and a `CostPick` for each request with a prompt of a block or more."""

    __slots__ = ("_balancer", "_block_chars", "_per_request", "_indexes")

    def __init__(self, settings: Settings) -> None:
        self._balancer = settings.balancer
        self._block_chars = settings.block_chars
        self._per_request = settings.tokens_per_request
        self._indexes = Indexes(settings.block_chars)

    def index(self, model: str) -> ModelIndex:
        return self._indexes.of(model)

    def chooser(self, model: str, doc: Mapping[str, Any], headers: Mapping[str, str] | None,
                prompt: PromptReader | None) -> CostPick | None:
        """None (least-load) without a prompt to hash: `prompt` is None when the route has none."""
        text = prompt(doc) if prompt is not None else None
        if not text:
            return None
        hashes = block_hashes(text, self._block_chars)
        if not hashes:
            return None     # shorter than a block: nothing an engine would cache
        per_block = self._block_chars / CHARS_PER_TOKEN
        return CostPick(self._balancer, self._indexes.of(model), hashes, per_block,
                        len(text) / CHARS_PER_TOKEN, self._per_request)

    def forget(self, alive: set[EndpointState]) -> None:
        self._indexes.retain(alive)
