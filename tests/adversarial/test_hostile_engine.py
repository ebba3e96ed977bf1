"""An engine is an untrusted peer: what it sends cannot exhaust or stall `serve` (issue 27, items 1-3).

One real `llmgwctl serve` on loopback runs a well-behaved fake engine beside
fake engines playing hostile (`llmgwctl engine fake --fault/--metrics-fault`,
see engines/fake_faults.py): a 10 GB Content-Length, a body without end,
header lines without end, one header growing without end, no answer at all,
a redirect, and /metrics pages of a million series, of 100 MB, and a
redirect. At 48de24a each of these grew serve's memory by gigabytes, wedged
the router, stalled /health for seconds per poll, or followed the redirect.

Every wait is bounded; nothing asserts how long anything took. Memory is
read from /proc with generous bounds: what is checked is that it does not
grow with what the engine sends (a 10 GB body, a 100 MB page), not a figure.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import requests

from tests.e2e.fleet import Fleet, wait_until
from tests.httptarget import CountingTarget

pytestmark = pytest.mark.timeout(240)

# serve's memory may grow by this much at most while hostile engines are at
# work: far below what any of them sends (GBs), far above what serving needs.
RSS_GROWTH_MB = 300


def _model(name: str, *args: str) -> str:
    return (f"  - name: {name}\n    replicas: 1\n    idle_timeout: 0\n"
            f"    profiles: [{{name: cpu, engine: fake, gpus: 0, args: {list(args)!r}}}]\n")


class _Watch:
    """/healthz on both ports, over and over on its own thread, each within a bounded timeout: any miss is kept."""

    def __init__(self, fleet: Fleet) -> None:
        self.urls = (fleet.router + "/healthz", fleet.control + "/healthz")
        self.misses: list[str] = []
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with requests.Session() as s:
            while not self._stop.is_set():
                for url in self.urls:
                    try:
                        if s.get(url, timeout=10).ok:
                            self.answered += 1
                        else:
                            self.misses.append(url)
                    except requests.RequestException as exc:
                        self.misses.append(f"{url}: {exc}")
                self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    target = CountingTarget()
    fleet = Fleet(tmp_path_factory.mktemp("hostile") / "fleet")
    to = ("--redirect-to", target.url + "/followed")
    (fleet.catalogs / "models.yaml").write_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n" + "".join((
        _model("good"),
        _model("huge", "--fault", "huge-length"),
        _model("endless", "--fault", "endless-body"),
        _model("headers", "--fault", "endless-headers"),
        _model("grow", "--fault", "growing-header"),
        _model("silent", "--fault", "no-headers"),
        _model("redirect", "--fault", "redirect", *to),
        _model("series", "--metrics-fault", "many-series"),
        _model("page", "--metrics-fault", "huge-page"),
        _model("metrics-redirect", "--metrics-fault", "redirect", *to),
    )))
    try:
        # Ports and CPU room for ten engines whatever the fleet's defaults (a
        # 2-core machine's local agent takes 8 CPU replicas); a short headers
        # bound, so the silent engine's request ends within the test.
        fleet.start_serve("--ports", f"{fleet._port_base}-{fleet._port_base + 49}", "--max-cpu-replicas", "16",
                          "--upstream-headers-timeout", "3")
        wait_until(lambda: len([r for r in fleet.replicas() if r["state"] == "ready"]) == 10,
                   "every engine ready", timeout=120)
        yield fleet, target
    finally:
        target.close()
        fleet.close()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _replica(fleet: Fleet, model: str) -> dict:
    (row,) = fleet.replicas(model)
    return row


def _chat(fleet: Fleet, model: str, **extra) -> requests.Response:
    return requests.post(fleet.router + "/v1/chat/completions", timeout=60, allow_redirects=False,
                         json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def _refusals(fleet: Fleet, reason: str) -> float:
    text = requests.get(fleet.router + "/metrics", timeout=10).text
    line = f'llmgw_router_engine_refusals_total{{reason="{reason}"}} '
    return sum(float(row[len(line):]) for row in text.splitlines() if row.startswith(line))


def _refused_with_the_replica_ejected(fleet: Fleet, model: str, code: str, *phrases: str) -> None:
    rid = _replica(fleet, model)["id"]
    resp = _chat(fleet, model)
    assert resp.status_code == 502, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert err["code"] == "upstream_out_of_bounds" and rid in err["message"], err
    for phrase in phrases:
        assert phrase in err["message"], err
    assert "location" not in {k.lower() for k in resp.headers}
    why = wait_until(lambda: _replica(fleet, model)["router"], f"{model}'s replica's router reason in status")
    assert why.startswith("ejected by the router") and phrases[0] in why, why
    assert _refusals(fleet, code) >= 1


def test_a_10_gb_content_length_is_a_502_unread_and_memory_stays_flat(hostile):
    fleet, _ = hostile
    watch = _Watch(fleet)
    try:
        before = _rss_mb(fleet.controller.pid)
        _refused_with_the_replica_ejected(fleet, "huge", "answer_too_large", "10000000000 bytes")
        # The replica is ejected, but a model whose every endpoint is ejected
        # still gets its requests (balancer: no failing on a guess): each is
        # refused the same way, unread.
        for _ in range(3):
            assert _chat(fleet, "huge").status_code == 502
        assert _rss_mb(fleet.controller.pid) - before < RSS_GROWTH_MB
        assert _chat(fleet, "good").status_code == 200
    finally:
        watch.stop()
    assert not watch.misses and watch.answered, watch.misses[:5]


def test_a_body_without_end_is_cut_at_the_cap_and_its_memory_returns(hostile):
    fleet, _ = hostile
    before = _rss_mb(fleet.controller.pid)
    _refused_with_the_replica_ejected(fleet, "endless", "answer_too_large", "more than the router's limit")
    assert _chat(fleet, "endless").status_code == 502
    # At most one answer's cap (64 MiB) is held at a time, and let go at once.
    assert _rss_mb(fleet.controller.pid) - before < RSS_GROWTH_MB
    assert _chat(fleet, "good").status_code == 200


def test_header_lines_without_end_are_refused_at_the_bound(hostile):
    fleet, _ = hostile
    before = _rss_mb(fleet.controller.pid)
    _refused_with_the_replica_ejected(fleet, "headers", "headers_too_large", "header")
    assert _rss_mb(fleet.controller.pid) - before < RSS_GROWTH_MB


def test_a_header_growing_without_end_does_not_wedge_the_router(hostile):
    fleet, _ = hostile
    watch = _Watch(fleet)
    try:
        _refused_with_the_replica_ejected(fleet, "grow", "headers_too_large", "header")
        assert _chat(fleet, "good").status_code == 200
    finally:
        watch.stop()
    assert not watch.misses and watch.answered, watch.misses[:5]


def test_an_engine_that_never_sends_headers_is_bounded_for_a_whole_answer(hostile):
    fleet, _ = hostile
    resp = _chat(fleet, "silent")       # not a stream: no idle timer applies, the headers bound does
    assert resp.status_code == 504, (resp.status_code, resp.text[:300])
    assert "no complete headers within 3 s" in resp.json()["error"]["message"]


def test_a_redirect_is_a_502_naming_the_engine_and_never_followed(hostile):
    fleet, target = hostile
    _refused_with_the_replica_ejected(fleet, "redirect", "redirect", "redirect")
    assert _chat(fleet, "redirect", stream=True).status_code == 502
    assert not [h for h in target.hits if h.startswith("/followed")], target.hits


@pytest.mark.parametrize("model", ["series", "page"])
def test_a_metrics_page_past_the_cap_is_not_read_but_counted_and_shown(hostile, model):
    fleet, _ = hostile
    watch = _Watch(fleet)
    try:
        why = wait_until(lambda: _replica(fleet, model)["router"], f"{model}'s /metrics refusal in status")
        assert "larger than the router reads" in why, why
        assert _refusals(fleet, "metrics_too_large") >= 1
        # Polls go on each second; requests and health checks meanwhile answer.
        for _ in range(5):
            assert _chat(fleet, "good").status_code == 200
            assert _chat(fleet, model).status_code == 200      # its answers are fine: only its page is refused
    finally:
        watch.stop()
    assert not watch.misses and watch.answered, watch.misses[:5]
    assert _rss_mb(fleet.controller.pid) < 1024


def test_a_redirecting_metrics_page_is_never_followed(hostile):
    fleet, target = hostile
    why = wait_until(lambda: _replica(fleet, "metrics-redirect")["router"], "the /metrics redirect in status")
    assert "redirect" in why, why
    assert _refusals(fleet, "metrics_redirect") >= 2          # polled again and again, and refused each time
    assert not [h for h in target.hits if h.startswith("/followed")], target.hits
