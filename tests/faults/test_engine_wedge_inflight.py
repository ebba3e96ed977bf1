"""A request already waiting on an engine that wedges (SIGSTOP) is answered by the other replica, through serve.

The whole fleet as shipped: `llmgwctl serve` with its router's defaults,
whose headers timeout is half an hour, and an agent with two fake replicas.
A whole (non-stream) answer's headers come only when its generation ends,
so the request waits on its engine for seconds; the engine is stopped
meanwhile. The replica leaves the routing (the router's ejection, or its
agent's report), and the request moves to the other replica then, as a
second attempt -- not half an hour later.
"""
import concurrent.futures
import os
import signal
import time

import requests

from llmgwctl.engines import parse_load
from tests.e2e.fleet import fake_catalog, wait_until

# 40 tokens at 10 a second: the answer's headers come after 4 s, so the request is in flight when its engine stops.
CATALOG = fake_catalog("talk", 2, "--tokens-per-second", "10")


def _running(row) -> bool:
    try:
        reading = parse_load("fake", requests.get(row["url"] + "/metrics", timeout=2).text)
    except requests.RequestException:
        return False
    return reading is not None and reading.running > 0


def test_a_request_waiting_on_a_wedged_engine_is_answered_by_the_other_replica(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    fleet.start_controller()
    fleet.start_agent("n1", "none")
    wait_until(lambda: len(fleet.ready("talk")) == 2, "both replicas ready")
    rows = fleet.ready("talk")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(fleet.chat, "talk", timeout=60, max_tokens=40, ignore_eos=True)
        victim = wait_until(lambda: next((r for r in rows if _running(r)), None), "the request running on a replica")
        os.kill(victim["pid"], signal.SIGSTOP)
        wedged_at = time.monotonic()
        try:
            resp = pending.result(timeout=60)
            moved_after = time.monotonic() - wedged_at
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-llmgw-replica"] != victim["id"]
    assert resp.headers["x-llmgw-attempts"] == "2"
    assert resp.json()["choices"][0]["message"]["content"]
    figure(f"answered by {resp.headers['x-llmgw-replica']} {moved_after:.1f} s after its first replica "
           f"{victim['id']} was SIGSTOPped (headers timeout 1800 s)")
