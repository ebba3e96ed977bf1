"""Prefix affinity through `llmgwctl serve`: two fake replicas with prefix caches, the router choosing by prefix.

Requests sharing a long system prompt all go to one replica (the one that
served it first), through the model's name and its alias alike, streamed or
not; once that replica is saturated -- its one slot taken and a request
queued behind it, as its /metrics says -- the next request with the same
prefix goes to the other replica instead of queueing.
"""
from __future__ import annotations

import requests

from .fleet import Fleet, endpoint_metrics, wait_until

MODEL = "chat"
# --max-num-seqs 1: a second request queues behind the first, so saturation is
# one long stream away. --tokens-per-second 5: that stream lasts seconds.
CATALOG = f"""\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: {MODEL}
    aliases: [assistant]
    routing: prefix
    replicas: 2
    profiles:
      - name: cpu
        engine: fake
        gpus: 0
        args: ["--max-num-seqs", "1", "--tokens-per-second", "5", "--prefix-cache-tokens", "100000"]
"""
SYSTEM = "You answer questions about the llmgw gateway, briefly and precisely. " * 40   # ~2,800 chars


def ask(fleet: Fleet, question: str, *, model: str = MODEL, stream: bool = False, max_tokens: int = 1):
    return requests.post(fleet.router + "/v1/chat/completions", stream=stream, timeout=60, json={
        "model": model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})


def waiting(fleet: Fleet, replica: str) -> float:
    """The engine's queue as the router last read it, for `replica` (series are labelled by slot, not replica id)."""
    return endpoint_metrics(fleet.router, replica).get("llmgw_router_endpoint_waiting_requests", 0.0)


def test_a_shared_prefix_sticks_to_one_replica_and_spreads_when_it_is_saturated(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "chat.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1", "--poll-interval", "0.2")
        wait_until(lambda: len(fleet.ready(MODEL)) == 2, "two ready replicas")
        wait_until(lambda: requests.get(fleet.router + "/healthz", timeout=2).json()["endpoints"] == 2,
                   "both endpoints in the router")
        first = ask(fleet, "what is a replica?")
        assert first.status_code == 200, first.text
        owner = first.headers["x-llmgw-replica"]
        seen = set()
        for i in range(6):
            r = ask(fleet, f"question {i}", model="assistant" if i % 2 else MODEL, stream=i % 3 == 0)
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-llmgw-replica"])
            r.close()
        assert seen == {owner}

        # Saturate the owner: one stream in its only slot, a second queued behind it.
        running = ask(fleet, "tell me everything", stream=True, max_tokens=60)
        queued = ask(fleet, "and more", stream=True, max_tokens=2)
        try:
            assert running.headers["x-llmgw-replica"] == owner
            assert queued.headers["x-llmgw-replica"] == owner    # a cold prefill elsewhere cost more than one ahead
            wait_until(lambda: waiting(fleet, owner) >= 1, "the router to read the owner's queue")
            spread = ask(fleet, "one more")
            assert spread.status_code == 200, spread.text
            other = spread.headers["x-llmgw-replica"]
            assert other != owner
        finally:
            running.close()
            queued.close()
    finally:
        fleet.close()
