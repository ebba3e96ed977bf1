"""Scenario 2: an engine killed with SIGKILL in the middle of a stream.

The stream it was serving has already sent its headers, so it cannot be
retried: it must end with an error event rather than hang or end as if
complete. Every request sent after the kill must succeed (the other replica
takes them, a refused connection is retried there), and the killed replica
must come back -- restarted by its agent, ready, and chosen again.
"""
import os
import signal
import time

import requests

from tests.e2e.fleet import wait_until

from .load import SteadyLoad, summary

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0, args: [--tokens-per-second, "20"]}]
"""


def test_engine_sigkill_mid_stream_ends_that_stream_with_an_error_and_costs_nothing_after(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    fleet.start_controller()
    fleet.start_agent("n1", "none")
    wait_until(lambda: len(fleet.ready("talk")) == 2, "both replicas ready")

    # ~10 s of stream at 20 tokens/s: the kill lands in its middle.
    with requests.post(fleet.router + "/v1/chat/completions", stream=True, timeout=60,
                       json={"model": "talk", "stream": True, "max_tokens": 200, "ignore_eos": True,
                             "messages": [{"role": "user", "content": "long"}]}) as resp:
        assert resp.status_code == 200, resp.text
        victim_id = resp.headers["x-llmgw-replica"]
        (victim,) = [r for r in fleet.replicas("talk") if r["id"] == victim_id]
        chunks = resp.iter_lines()
        before_kill = [next(chunks) for _ in range(6)]      # a few tokens: the stream is really under way
        with SteadyLoad(fleet.router, ["talk"], workers=2) as load:
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            rest = list(chunks)                             # bounded by the request's 60 s read timeout
            tail = b"\n".join(line for line in rest if line)
            # Back: restarted by its agent with a new process, ready, and serving again.
            back = wait_until(lambda: [r for r in fleet.ready("talk") if r["id"] == victim_id and r["pid"] != victim["pid"]],
                              "the killed replica restarted and ready")
            recovered = time.monotonic() - killed_at
            wait_until(lambda: any(o.replica == victim_id for o in load.since(time.monotonic() - 1)),
                       "the restarted replica chosen again", every=0.2)
    after = load.since(killed_at)
    figure(f"stream cut after {len([c for c in before_kill if c])} events, ended with "
           f"{'an error event' if b'error' in tail else 'NO error event'}; after the kill {summary(after)}; "
           f"replica back ready in {recovered:.1f} s (restarts {back[0]['restarts']})")
    assert b'"error"' in tail and not tail.rstrip().endswith(b"data: [DONE]"), tail[-300:]
    assert load.failures(after) == [], load.failures(after)[:5]
    assert back[0]["restarts"] == 1


SOLO = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: solo
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def test_the_only_engine_of_a_model_killed_costs_its_clients_a_wait_not_an_error(fleet, figure):
    """With one replica there is nowhere else to go: requests wait for the restart, as for a cold start."""
    (fleet.catalogs / "models.yaml").write_text(SOLO)
    fleet.start_controller()
    fleet.start_agent("n1", "none")
    (victim,) = wait_until(lambda: fleet.ready("solo"), "solo ready")
    with SteadyLoad(fleet.router, ["solo"], workers=3) as load:
        load.wait_for(10)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: [r for r in fleet.ready("solo") if r["pid"] != victim["pid"]], "solo restarted and ready")
        recovered = time.monotonic() - killed_at
        load.wait_for(10)
    after = load.since(killed_at)
    caught = [o for o in load.outcomes if o.started < killed_at < o.ended]   # in flight at the kill
    slowest = max(o.ended - o.started for o in after + caught)
    figure(f"the only replica killed: after the kill {summary(after)}; in flight at the kill {summary(caught)}; "
           f"slowest {slowest:.1f} s; back ready in {recovered:.1f} s")
    assert load.failures(after) == [], load.failures(after)[:5]
