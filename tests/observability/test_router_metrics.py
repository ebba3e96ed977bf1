"""The router's /metrics, scraped while real requests go through a real router to a real fake engine."""
from __future__ import annotations

import json
import logging
import math
import socket
import threading

import requests

from llmgwctl.catalog import Catalog, Model, Profile
from llmgwctl.contracts import Endpoint
from llmgwctl.router.usage import StreamUsage, usage_tokens
from tests.router.harness import catalog, make_router, wait_until

from .scrape import delta, finite, key, scrape

MODEL = "obs-model"


def chat(url: str, model: str = MODEL, **extra) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=30,
                         json={"model": model, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4,
                               **extra})


def stream_usage(resp: requests.Response) -> tuple[int, int]:
    """The usage block of an SSE stream's last data chunk that has one."""
    found = None
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            doc = json.loads(line[6:])
            if doc.get("usage"):
                found = (doc["usage"]["prompt_tokens"], doc["usage"]["completion_tokens"])
    assert found is not None, resp.text
    return found


def test_counters_move_exactly_as_the_requests_did(engines, routers):
    engine = engines(MODEL, "obs-r1")
    rt = routers(make_router(catalog((MODEL, ("obs-alias",))), poll_interval=0.2))
    rt.set_endpoints([engine.endpoint()])
    before = scrape(rt.url + "/metrics")
    tokens_in = tokens_out = 0
    for i in range(5):
        r = chat(rt.url, MODEL if i % 2 else "obs-alias")
        assert r.status_code == 200, r.text
        # The overhead header is there, a number of milliseconds.
        assert float(r.headers["x-llmgw-overhead-ms"]) >= 0
        tokens_in += r.json()["usage"]["prompt_tokens"]
        tokens_out += r.json()["usage"]["completion_tokens"]
    for _ in range(3):
        r = chat(rt.url, stream=True, stream_options={"include_usage": True})
        assert r.status_code == 200 and float(r.headers["x-llmgw-overhead-ms"]) >= 0
        p, c = stream_usage(r)
        tokens_in, tokens_out = tokens_in + p, tokens_out + c
    assert chat(rt.url, "no-such-model").status_code == 404
    assert requests.post(rt.url + "/v1/chat/completions", data=b"{not json", timeout=10).status_code == 400
    after = scrape(rt.url + "/metrics")

    served = dict(model=MODEL, endpoint="obs-model/default/0", code="200")
    assert delta(before, after, "llmgw_router_requests_total", **served) == 8
    # Requests answered before an endpoint was chosen: no endpoint, and never the client's model string.
    assert delta(before, after, "llmgw_router_requests_total", model="", endpoint="", code="404") == 1
    assert delta(before, after, "llmgw_router_requests_total", model="", endpoint="", code="400") == 1
    assert not any(name == "llmgw_router_requests_total" and ("model", "no-such-model") in labels
                   for name, labels in after)
    assert delta(before, after, "llmgw_router_tokens_total", model=MODEL, direction="in") == tokens_in > 0
    assert delta(before, after, "llmgw_router_tokens_total", model=MODEL, direction="out") == tokens_out > 0
    assert delta(before, after, "llmgw_router_request_duration_seconds_count", model=MODEL) == 8
    assert delta(before, after, "llmgw_router_time_to_first_byte_seconds_count", model=MODEL) == 8
    assert delta(before, after, "llmgw_router_overhead_seconds_count") == 8
    assert after[key("llmgw_router_inflight_requests", model=MODEL, endpoint="obs-model/default/0")] == 0
    assert after[key("llmgw_router_ready_endpoints", model=MODEL)] == 1
    assert after[key("llmgw_router_catalog_info", version=rt.router.catalog.version)] == 1


def test_in_flight_and_poll_staleness_are_read_at_scrape_time(engines, routers):
    slow = engines(MODEL, "obs-slow", "--ttft", "30")
    rt = routers(make_router(catalog((MODEL, ())), poll_interval=0.2))
    rt.set_endpoints([slow.endpoint()])
    age = key("llmgw_router_endpoint_metrics_age_seconds", endpoint="obs-model/default/0")
    wait_until(lambda: finite(scrape(rt.url + "/metrics").get(age, math.inf)), timeout=10, what="a first load reading")

    holder = threading.Thread(target=lambda: _swallow(lambda: chat(rt.url)), daemon=True)
    holder.start()
    inflight = key("llmgw_router_inflight_requests", model=MODEL, endpoint="obs-model/default/0")
    wait_until(lambda: scrape(rt.url + "/metrics").get(inflight) == 1, timeout=10, what="one request in flight")
    # The reading the balancer weighs this endpoint by, as the engine's page said it.
    running = key("llmgw_router_endpoint_running_requests", endpoint="obs-model/default/0")
    wait_until(lambda: scrape(rt.url + "/metrics").get(running) == 1, timeout=10, what="the engine's running count")
    now = scrape(rt.url + "/metrics")
    assert now[key("llmgw_router_endpoint_waiting_requests", endpoint="obs-model/default/0")] == 0
    assert 0 < now[key("llmgw_router_endpoint_kv_cache_usage_ratio", endpoint="obs-model/default/0")] < 1

    slow.kill()     # the poller gets no more readings: the age keeps growing
    first = scrape(rt.url + "/metrics")[age]
    wait_until(lambda: scrape(rt.url + "/metrics")[age] > first + 0.5, timeout=10, what="the reading to age")
    holder.join(30)
    wait_until(lambda: scrape(rt.url + "/metrics").get(inflight) == 0, timeout=10, what="the in-flight count to drop")


def _swallow(fn):
    try:
        fn()
    except requests.RequestException:
        pass


def test_a_replacement_replica_continues_the_series_of_the_one_it_replaced(engines, routers):
    # The endpoint label is a slot (model/profile/N), not the replica id:
    # replica ids are never reused, so a restart would otherwise start new
    # series and grow them without end.
    first = engines(MODEL, "obs-gone")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([first.endpoint()])
    assert chat(rt.url).status_code == 200
    slot = f"{MODEL}/default/0"
    served = key("llmgw_router_requests_total", model=MODEL, endpoint=slot, code="200")
    info = key("llmgw_router_endpoint_info", endpoint=slot, model=MODEL, profile="default", replica="obs-gone",
               url=first.url)
    page = scrape(rt.url + "/metrics")
    assert page[served] == 1 and page[info] == 1
    rt.set_endpoints([])
    page = scrape(rt.url + "/metrics")
    # The replica's own series (its info, its gauges) are gone; the slot's counter stays.
    assert not any(("replica", "obs-gone") in labels for _, labels in page)
    assert page[served] == 1
    second = engines(MODEL, "obs-new")
    other = engines(MODEL, "obs-other")
    rt.set_endpoints([second.endpoint(), other.endpoint()])
    for _ in range(4):
        assert chat(rt.url).status_code == 200
    page = scrape(rt.url + "/metrics")
    slots = {dict(labels)["replica"]: dict(labels)["endpoint"] for name, labels in page
             if name == "llmgw_router_endpoint_info"}
    # The first newcomer takes the free slot 0, the next one slot 1.
    assert slots == {"obs-new": slot, "obs-other": f"{MODEL}/default/1"}
    by_slot = {dict(labels)["endpoint"]: v for (name, labels), v in page.items()
               if name == "llmgw_router_requests_total" and dict(labels).get("code") == "200"}
    # The four may all go to one replica (the same prompt: prefix affinity), and a
    # slot that served nothing has no series yet.
    assert by_slot[slot] + by_slot.get(f"{MODEL}/default/1", 0) == 5 and by_slot[slot] >= 1
    assert not any(name.endswith("_created") for name, _ in page)


def test_build_info_and_no_created_series(routers):
    import platform

    from llmgwctl import __version__
    rt = routers(make_router(catalog((MODEL, ()))))
    text = requests.get(rt.url + "/metrics", timeout=10).text
    page = scrape(rt.url + "/metrics")
    assert page[key("llmgw_build_info", version=__version__, python=platform.python_version())] == 1
    assert "_created" not in text


class NoopWaker:
    def __init__(self):
        self.calls = []

    def wake(self, model_name: str) -> None:
        self.calls.append(model_name)


def test_cold_queue_length_and_wait(routers):
    cold = Catalog([Model(name="cold-model", source="org/cold",
                          profiles=(Profile(name="default", engine="fake", gpus=0),))])
    waker = NoopWaker()
    rt = routers(make_router(cold, waker=waker, cold_timeout=3.0))
    queue = key("llmgw_router_cold_queue_length", model="cold-model")
    assert scrape(rt.url + "/metrics")[queue] == 0
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", chat(rt.url, "cold-model")), daemon=True)
    t.start()
    wait_until(lambda: scrape(rt.url + "/metrics")[queue] == 1, timeout=10, what="one request waiting")
    t.join(30)
    assert result["r"].status_code == 503 and waker.calls == ["cold-model"]
    page = scrape(rt.url + "/metrics")
    assert page[queue] == 0
    assert page[key("llmgw_router_cold_wait_seconds_count", model="cold-model", outcome="timeout")] == 1
    assert page[key("llmgw_router_requests_total", model="cold-model", endpoint="", code="503")] == 1


def test_a_wait_for_a_replica_to_come_back_is_a_cold_wait_too(routers):
    # The model's only endpoint refuses its connection (its engine crashed,
    # the agent is restarting it): the request waits as for a cold start, and
    # that wait is observed like one -- here it runs out, as nothing comes back.
    with socket.socket() as s:      # bound, not listening: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        rt = routers(make_router(catalog((MODEL, ())), waker=NoopWaker(), cold_timeout=1.0))
        rt.set_endpoints([Endpoint("gone", MODEL, "default", "fake", f"http://127.0.0.1:{port}")])
        r = chat(rt.url)
    assert r.status_code == 503 and r.json()["error"]["code"] == "cold_start_timeout"
    page = scrape(rt.url + "/metrics")
    assert page[key("llmgw_router_cold_wait_seconds_count", model=MODEL, outcome="timeout")] == 1
    assert page[key("llmgw_router_requests_total", model=MODEL, endpoint="", code="503")] == 1


def test_access_log_one_line_per_request_and_it_can_be_turned_off(engines, routers, caplog):
    engine = engines(MODEL, "obs-log")
    on = routers(make_router(catalog((MODEL, ()))))
    off = routers(make_router(catalog((MODEL, ())), access_log=False))
    on.set_endpoints([engine.endpoint()])
    off.set_endpoints([engine.endpoint()])
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        assert chat(on.url).status_code == 200
        assert chat(on.url, "missing").status_code == 404
        assert chat(off.url).status_code == 200
    lines = [r for r in caplog.records if r.name == "llmgw.access"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    ok, missing = lines
    assert ok.status == 200 and ok.model == MODEL and ok.endpoint == "obs-log" and ok.overhead_ms >= 0
    assert "POST /v1/chat/completions 200 model=obs-model endpoint=obs-log" in ok.getMessage()
    assert missing.status == 404 and missing.model == ""


def test_usage_tokens_reads_replies_and_chunks_without_parsing_them():
    reply = b'{"id":"x","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}'
    assert usage_tokens(reply) == (12, 7)
    embed = b'{"data":[],"usage":{"prompt_tokens":5,"total_tokens":5}}'
    assert usage_tokens(embed) == (5, 0)
    details = (b'data: {"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0},'
               b'"completion_tokens":9}}\n\n')
    assert usage_tokens(details) == (3, 9)
    assert usage_tokens(b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n') is None
    assert usage_tokens(b'{"choices":[]}') is None


USAGE_LINE = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
              b'"usage":{"prompt_tokens":11,"total_tokens":31,"completion_tokens":20}}\n\n')
CONTENT_LINE = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"tok"}}],"usage":null}\n\n'


def test_stream_usage_is_read_wherever_the_socket_cut_the_stream():
    stream = CONTENT_LINE * 3 + USAGE_LINE + b"data: [DONE]\n\n"
    # Every place a read of the socket could end, "usage" itself included.
    for cut in range(1, len(stream)):
        scan = StreamUsage()
        scan.feed(stream[:cut])
        scan.feed(stream[cut:])
        assert scan.usage == (11, 20), cut
    scan = StreamUsage()
    for i in range(len(stream)):        # one byte per read
        scan.feed(stream[i:i + 1])
    assert scan.usage == (11, 20)


def test_stream_usage_on_every_chunk_counts_the_last_running_total_once():
    # vLLM's continuous_usage_stats: every chunk carries the totals so far.
    scan = StreamUsage()
    for n in range(1, 6):
        scan.feed(b'data: {"choices":[{"delta":{"content":"t"}}],"usage":{"prompt_tokens":4,'
                  b'"completion_tokens":%d,"total_tokens":%d}}\n\n' % (n, 4 + n))
    assert scan.usage == (4, 5)
    scan = StreamUsage()
    scan.feed(CONTENT_LINE * 4 + b"data: [DONE]\n\n")
    assert scan.usage is None


def test_usage_per_api_key_is_labelled_by_the_key_name_never_the_secret(tmp_path, engines, routers):
    from llmgwctl.router.auth import KeyFileWatcher, hash_key
    secret_a, secret_b = "sk-obs-a-" + "a" * 32, "sk-obs-b-" + "b" * 32
    engine = engines(MODEL, "obs-keys")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([engine.endpoint()])
    path = tmp_path / "keys.yaml"

    def write(*names_secrets):
        path.write_text("keys:\n" + "".join(
            f"  - {{name: {n}, sha256: {hash_key(k)}, models: ['*'], rpm: 1000}}\n" for n, k in names_secrets))
    write(("team-a", secret_a), ("team-b", secret_b))
    watcher = KeyFileWatcher(path, rt.router.set_api_keys)
    rt.call(watcher.load_initial)
    auth = {"Authorization": f"Bearer {secret_a}"}
    prompt = completion = 0
    for _ in range(3):
        r = requests.post(rt.url + "/v1/chat/completions", headers=auth, timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
        prompt += r.json()["usage"]["prompt_tokens"]
        completion += r.json()["usage"]["completion_tokens"]
    r = requests.post(rt.url + "/v1/chat/completions", headers=auth, json={"model": "nope"}, timeout=30)
    assert r.status_code == 404
    bees = {"Authorization": f"Bearer {secret_b}"}
    text = requests.get(rt.url + "/metrics", headers=bees, timeout=10).text
    page = scrape(rt.url + "/metrics", headers=bees)
    assert page[key("llmgw_router_key_requests_total", key="team-a", code="200")] == 3
    assert page[key("llmgw_router_key_requests_total", key="team-a", code="404")] == 1
    assert page[key("llmgw_router_key_tokens_total", key="team-a", direction="in")] == prompt > 0
    assert page[key("llmgw_router_key_tokens_total", key="team-a", direction="out")] == completion > 0
    assert secret_a not in text and hash_key(secret_a) not in text
    # A key that leaves the file takes its series with it.
    write(("team-b", secret_b))
    rt.call(watcher.reload)
    page = scrape(rt.url + "/metrics", headers=bees)
    assert not any(("key", "team-a") in labels for _, labels in page)
