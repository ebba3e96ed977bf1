"""Prefix and session affinity, round robin: the index, the hashes and the pick, on pure state (no network)."""
from __future__ import annotations

import collections
import random

from llmgwctl.catalog.model import ROUTING_POLICIES
from llmgwctl.contracts import Endpoint, LoadReading
from llmgwctl.router import prefix
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.prefix import BLOCK_CHARS, EndpointIndex, Policies, block_hashes, capacity_blocks, prompt_text

from ..support import FakeClock

# The tests state the cost model's exchange rate rather than inherit the
# default, so their arithmetic stays true when the default is retuned.
PER_REQUEST = 512.0
SYSTEM = "You are a careful assistant for the ACME support desk. " * 40     # ~2,200 chars: 8 blocks


def ep(rid: str, weight: float = 1.0, url: str | None = None) -> Endpoint:
    return Endpoint(replica_id=rid, model="m", profile="p", engine="fake",
                    url=url or f"http://127.0.0.1:{2000 + sum(map(ord, rid))}", weight=weight)


def make(*rids: str) -> tuple[Balancer, Policies, FakeClock]:
    clock = FakeClock()
    b = Balancer(clock=clock, stale_after=3.0, rng=random.Random(7))
    b.set_endpoints([ep(r) for r in rids])
    return b, Policies(b, tokens_per_request=PER_REQUEST), clock


def state(b: Balancer, rid: str):
    return next(s for s in b.states() if s.replica_id == rid)


def chat(question: str, system: str = SYSTEM, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": question}], **extra}


def pick(b: Balancer, p: Policies, doc: dict, policy: str = "prefix", headers=None) -> str:
    st = b.pick("m", (), p.chooser(policy, "m", doc, headers))
    assert st is not None
    return st.replica_id


# -- the text and its hashes ----------------------------------------------------------

def test_prompt_text_keeps_roles_and_order_so_shared_leading_messages_share_a_leading_string():
    a = prompt_text(chat("first question"))
    b = prompt_text(chat("another one"))
    assert a is not None and b is not None
    assert a[:len(SYSTEM) + 10] == b[:len(SYSTEM) + 10] and a != b
    assert "system" in a and "user" in a and a.index("system") < a.index("first question")
    # Content parts: the text ones count, as the template renders them.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image_url"},
                                                       {"type": "text", "text": "there"}]}]}
    assert "hi there" in prompt_text(parts)
    assert prompt_text({"prompt": ["once upon a time"]}) == "once upon a time"
    assert prompt_text({"prompt": [1, 2, 3]}) is None
    assert prompt_text({"messages": ["not an object"]}) is None


def test_hashes_are_chained_so_equal_blocks_after_different_prefixes_differ():
    x = "x" * BLOCK_CHARS
    y = "y" * BLOCK_CHARS
    assert len(block_hashes(x + y + "partial")) == 2              # the partial block is left out
    assert block_hashes(x + y)[0] == block_hashes(x + x)[0]
    assert block_hashes(x + y)[1] != block_hashes(y + y)[1]       # same block text, different prefix
    assert block_hashes("short") == []


def test_prompt_text_and_hashing_are_bounded_for_huge_prompts():
    doc = {"prompt": "z" * (prefix.MAX_BLOCKS * BLOCK_CHARS * 4)}
    assert len(block_hashes(prompt_text(doc))) == prefix.MAX_BLOCKS


# -- the index --------------------------------------------------------------------------

def test_index_matches_the_longest_held_prefix():
    idx = EndpointIndex(capacity=100)
    hs = block_hashes(SYSTEM + "tail" * 100)
    idx.record(hs[:5])
    assert idx.match(hs) == 5
    assert idx.match(hs[:3]) == 3
    assert idx.match(block_hashes("q" * 2000)) == 0


def test_index_is_a_bounded_lru_that_evicts_a_prefix_from_its_end():
    idx = EndpointIndex(capacity=8)
    old = block_hashes("a" * BLOCK_CHARS * 6)
    new = block_hashes("b" * BLOCK_CHARS * 4)
    idx.record(old)
    idx.record(new)
    assert len(idx) == 8
    # The two evicted were old's last blocks, not its first: what is left is still a prefix.
    assert idx.match(old) == 4 and idx.match(new) == 4
    idx.record(old)     # touched again: most recent, new loses its tail
    assert idx.match(old) == 6 and idx.match(new) == 2


def test_capacity_comes_from_the_engines_cache_size_when_known():
    b, _, _ = make("a")
    st = state(b, "a")
    assert capacity_blocks(st) == int(prefix.DEFAULT_CACHE_TOKENS * prefix.CHARS_PER_TOKEN / BLOCK_CHARS)
    b.record(st, LoadReading(running=0, waiting=0, kv_cache=0.0, cache_tokens=6400))
    assert capacity_blocks(st) == 100


# -- the pick -----------------------------------------------------------------------------

def test_requests_sharing_a_prefix_go_to_the_replica_that_served_it():
    b, p, _ = make("a", "b", "c", "d")
    first = pick(b, p, chat("hello"))
    assert {pick(b, p, chat(f"question {i}")) for i in range(50)} == {first}


def test_different_prefixes_spread_over_replicas():
    b, p, _ = make("a", "b", "c", "d")
    owners = {}
    for k in range(8):
        system = f"tenant {k} " + SYSTEM
        owner = pick(b, p, chat("hi", system=system))
        st = state(b, owner)
        st.inflight += 1      # it is still running: the next prefix should look elsewhere
        owners[k] = owner
    assert len(set(owners.values())) == 4
    # ...and each prefix keeps its replica afterwards (equal load again).
    for st in b.states():
        st.inflight = 0
    for k, owner in owners.items():
        assert pick(b, p, chat("again", system=f"tenant {k} " + SYSTEM)) == owner


def test_a_hot_prefix_spreads_once_its_replica_is_busy_enough():
    b, p, _ = make("a", "b")
    owner = pick(b, p, chat("hello"))
    other = "b" if owner == "a" else "a"
    # The prompt is ~560 tokens; one request ahead is worth 512 uncached tokens,
    # so one in flight on the owner still beats a cold prefill elsewhere...
    state(b, owner).inflight = 1
    assert pick(b, p, chat("q1")) == owner
    # ...two do not.
    state(b, owner).inflight = 2
    assert pick(b, p, chat("q2")) == other
    # The second replica has learnt the prefix: at equal load both are candidates.
    state(b, owner).inflight = state(b, other).inflight = 0
    assert set(collections.Counter(pick(b, p, chat(f"q{i}")) for i in range(200))) == {"a", "b"}


def test_a_replica_with_requests_queued_is_not_a_candidate_however_much_it_holds():
    b, p, _ = make("a", "b")
    owner = pick(b, p, chat("hello"))
    b.record(state(b, owner), LoadReading(running=4, waiting=1, kv_cache=0.5))
    assert pick(b, p, chat("more")) != owner


def test_without_any_cached_block_the_pick_is_least_loads():
    """Zero reuse: the prefix policy picks exactly what least-load picks, draw for draw."""
    picks = {}
    for policy in ("least-load", "prefix"):
        b, p, _ = make("a", "b", "c")
        state(b, "a").inflight = 3
        state(b, "b").inflight = 1
        picks[policy] = [pick(b, p, {"prompt": f"request {i} " + "fresh words " * 100}, policy) for i in range(40)]
    assert picks["prefix"] == picks["least-load"]
    assert len(set(picks["prefix"])) > 1        # two random choices, not always the idlest


def test_short_prompts_and_bodies_without_one_fall_back_to_least_load():
    b, p, _ = make("a", "b")
    assert p.chooser("prefix", "m", {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert p.chooser("prefix", "m", {"input": "an embedding"}) is None
    assert p.chooser("least-load", "m", chat("x")) is None
    assert p.chooser(None, "m", chat("x")) is None


def test_weight_scales_the_cost_of_a_cold_prefill():
    """The same loads, the other replica twice as fast or not: the weight decides who takes the miss."""
    def owner_with(fast_weight: float) -> str:
        b = Balancer(clock=FakeClock(), stale_after=3.0, rng=random.Random(1))
        b.set_endpoints([ep("holder"), ep("other", weight=fast_weight)])
        p = Policies(b, tokens_per_request=PER_REQUEST)
        p.index("m").of(state(b, "holder")).record(block_hashes(prompt_text(chat("x"))))
        b.record(state(b, "holder"), LoadReading(running=3, waiting=0))
        b.record(state(b, "other"), LoadReading(running=3, waiting=0))
        return pick(b, p, chat("y"))
    # The holder has 512 of the ~556 tokens cached. The other's cold prefill is
    # worth ~1.1 requests at weight 1, ~0.54 at weight 2: 3.09 against 3 + 1.09
    # keeps the holder; against 1.5 + 0.54 it does not.
    assert owner_with(1.0) == "holder"
    assert owner_with(2.0) == "other"


# -- robust to change --------------------------------------------------------------------------

def test_a_new_replica_starts_empty_and_a_removed_one_drops_its_index():
    b, p, _ = make("a", "b")
    owner = pick(b, p, chat("hello"))
    b.set_endpoints([ep("a"), ep("b"), ep("c")])
    assert pick(b, p, chat("again")) == owner           # kept, learnt state survives the change
    assert p.index("m").get(state(b, "c")) is None
    b.set_endpoints([ep(r) for r in ("a", "b", "c") if r != owner])
    pick(b, p, chat("after removal"))
    assert len(p.index("m")) == 1                        # the removed replica's index is gone


def test_a_replica_restarted_under_a_new_url_has_an_empty_index():
    b, p, _ = make("a")
    pick(b, p, chat("hello"))
    old = state(b, "a")
    assert p.index("m").get(old) is not None
    b.set_endpoints([ep("a", url="http://127.0.0.1:9999")])
    assert p.index("m").get(state(b, "a")) is None


# -- session affinity and round robin ---------------------------------------------------------

def test_session_affinity_by_user_field_or_header():
    b, p, _ = make("a", "b", "c", "d")
    first = pick(b, p, chat("hi", system="short", user="alice"), "session")
    assert {pick(b, p, chat(f"turn {i}", system="other", user="alice"), "session") for i in range(20)} == {first}
    by_header = pick(b, p, chat("hi", system="s"), "session", {"x-llmgw-session": "s-1"})
    assert {pick(b, p, chat("x", system="t"), "session", {"x-llmgw-session": "s-1"}) for _ in range(20)} == {by_header}
    assert p.chooser("session", "m", chat("no session")) is None


def test_round_robin_takes_each_candidate_in_turn():
    b, p, _ = make("a", "b", "c")
    state(b, "a").inflight = 10       # load is ignored
    got = [pick(b, p, chat(str(i)), "round-robin") for i in range(9)]
    assert collections.Counter(got) == {"a": 3, "b": 3, "c": 3}
    assert got[:3] != got[3:6] or len(set(got[:3])) == 3


def test_the_catalogs_policies_are_the_routers():
    assert ROUTING_POLICIES == prefix.POLICIES

