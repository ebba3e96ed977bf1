"""Issue 27: the router's memory comes back after large bodies, against a real `llmgwctl router` process.

At 12b0e0b it did not: glibc's mmap threshold crept up to the size of the
first large body freed, so the next bodies, their growing buffers and their
copies came from the heap, and what they left there in pieces stayed
resident (serve +139 MB after the hostile bench, for good). Now the router
fixes the threshold at start and trims the heap once large bodies were let
go (`llmgwctl.allocator`).

Bounded waits, no timing asserts: the router's RSS must come back near
where it started within a generous wait.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from llmgwctl import allocator

from .test_router_inputs import fleet_files  # noqa: F401 -- the fixture: a router process and a fake engine

pytestmark = pytest.mark.skipif(allocator.unavailable() is not None, reason=str(allocator.unavailable()))


def _body(mib: int, fill: str) -> bytes:
    doc = {"model": "team-a-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    head = json.dumps(doc).encode()[:-1]
    return head + b', "pad": "' + fill.encode() * (mib << 20) + b'"}'


def test_the_routers_memory_comes_back_after_large_bodies(fleet_files, figure):  # noqa: F811
    *_, spawn = fleet_files
    router = spawn()
    url = router.url + "/v1/chat/completions"
    for _ in range(3):
        assert router.chat().status_code == 200         # warm: the pool, the parser's worker, the loop's buffers
    start = router.rss_kib()

    def send(i: int) -> int:
        # Of different sizes, so each is a new buffer rather than the last one's memory reused.
        data = _body(4 + 2 * (i % 5), "abcdefgh"[i % 8])
        return requests.post(url, data=data, headers={"Content-Type": "application/json"}, timeout=120).status_code

    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(send, range(24)))
    # Forwarded (the fake engine may refuse a body this large itself) or refused by the budget, never failed.
    assert all(s in (200, 413, 429, 503) for s in statuses), statuses
    peak = router.rss_kib("VmHWM")
    # Four bodies of at least 4 MiB in flight at once hold 16 MiB (the parser's
    # worker gets them down a pipe, no pickled copy beside them since 2026-12-03).
    assert peak - start > 16 << 10, f"the bodies never raised the router's RSS ({start} -> {peak} KiB): no test"
    assert router.chat().status_code == 200

    # At 12b0e0b this load left it 32 MiB up (61 -> peak 141 -> 93 MiB), now 3-4 MiB.
    margin = 12 << 10
    deadline = time.monotonic() + 60
    now = router.rss_kib()
    while now - start > margin and time.monotonic() < deadline:
        time.sleep(0.5)
        now = router.rss_kib()
    figure(f"24 bodies of 4-12 MiB, 4 at a time, through a router: RSS {start >> 10} MiB at the start, peak {peak >> 10}, "
           f"back to {now >> 10}")
    assert now - start <= margin, f"the router's RSS stayed {(now - start) >> 10} MiB above where it started " \
                                  f"({start >> 10} -> peak {peak >> 10} -> {now >> 10} MiB)"
