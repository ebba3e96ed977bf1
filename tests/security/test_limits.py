"""Input limits on the router: slow clients, big bodies, big headers, deep JSON, too many connections.

Each test shows the bad client bounded and the other clients still served by
the same router, with a real fake engine behind it. Raw sockets play the bad
clients, because an HTTP library would not misbehave on purpose.
"""
from __future__ import annotations

import json
import re
import socket
import threading

import pytest
import requests

from llmgwctl.contracts import Endpoint
from tests.router.harness import catalog, make_router, wait_until

MODEL = "lim-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def served(engine) -> float:
    text = requests.get(engine.url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def ok(url: str) -> bool:
    return requests.post(url + "/v1/chat/completions", json=BODY, timeout=30).status_code == 200


def connect(url: str) -> socket.socket:
    host, port = url.rsplit("/", 1)[-1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_status(s: socket.socket, timeout: float = 20) -> int | None:
    """The status code of the response on `s`, or None if the router closed it without one."""
    s.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    m = re.match(rb"HTTP/1\.1 (\d{3})", data)
    return int(m.group(1)) if m else None


@pytest.fixture
def served_router(engines, routers):
    def make(**config):
        engine = engines(MODEL, f"lim-{len(config)}-{id(config)}")
        rt = routers(make_router(catalog((MODEL, ())), **config))
        rt.set_endpoints([engine.endpoint()])
        return rt, engine
    return make


def test_slowloris_headers_at_one_byte_a_second_are_cut_and_others_are_served(served_router):
    # A short idle timeout so the test sees the cut; the default is 75 s.
    rt, engine = served_router(client_idle_timeout=2.0)
    header = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-Padding: " + b"a" * 200 + b"\r\n\r\n")
    slow = [connect(rt.url) for _ in range(20)]
    sent = [0] * len(slow)
    closed = [False] * len(slow)
    stop = threading.Event()

    def trickle(i: int) -> None:
        s = slow[i]
        while not stop.is_set() and sent[i] < len(header):
            try:
                s.send(header[sent[i]:sent[i] + 1])
            except OSError:
                break
            sent[i] += 1
            stop.wait(1.0)
        try:
            s.settimeout(30)
            closed[i] = s.recv(1) == b""
        except OSError:
            closed[i] = True

    threads = [threading.Thread(target=trickle, args=(i,), daemon=True) for i in range(len(slow))]
    for t in threads:
        t.start()
    try:
        # While twenty clients trickle their headers, everyone else is served.
        for _ in range(10):
            assert ok(rt.url)
        for t in threads:
            t.join(40)
        assert all(closed), "every slow connection was closed by the router"
        assert max(sent) < len(header), "...before it finished sending its headers"
        assert ok(rt.url)
    finally:
        stop.set()
        for s in slow:
            s.close()


def test_oversized_bodies_are_refused_unread_and_others_are_served(served_router):
    rt, engine = served_router(max_body_bytes=1024 * 1024)
    # Declared too large: refused before a byte of the body is read.
    s = connect(rt.url)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 50000000\r\n\r\n" + b"{" * 1000)
    assert read_status(s) == 413
    s.close()
    # Undeclared (chunked) and too large: refused once the limit is crossed.
    big = b'{"model": "lim-model", "pad": "' + b"x" * (3 * 1024 * 1024) + b'"}'

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    try:
        r = requests.post(rt.url + "/v1/chat/completions", data=chunks(), timeout=30,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 413
    except requests.ConnectionError:
        pass    # the router answered 413 and closed while the client was still sending: also refused
    assert ok(rt.url)
    assert served(engine) == 1      # only the good request reached the engine


def test_a_body_that_stops_arriving_gets_408(served_router):
    rt, engine = served_router(body_timeout=1.0)
    s = connect(rt.url)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\": ")
    assert ok(rt.url)                   # served while that body is stuck
    assert read_status(s) == 408
    s.close()
    assert served(engine) == 1


def test_oversized_headers_are_refused(served_router):
    rt, engine = served_router()
    huge = requests.post(rt.url + "/v1/chat/completions", json=BODY, timeout=30, headers={"X-Big": "a" * 20000})
    assert huge.status_code in (400, 431), huge.status_code
    many = requests.post(rt.url + "/v1/chat/completions", json=BODY, timeout=30,
                         headers={f"X-H{i}": "v" for i in range(300)})
    assert many.status_code in (400, 431), many.status_code
    assert served(engine) == 0
    assert ok(rt.url)


def test_deeply_nested_json_is_400_before_anything_walks_it(served_router):
    rt, engine = served_router(max_json_depth=64)
    deep = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}
    node: list = []
    deep["tools"] = node
    for _ in range(100):
        node.append([])
        node = node[0]
    r = requests.post(rt.url + "/v1/chat/completions", data=json.dumps(deep), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_deep"
    # Deeper than Python's own recursion limit: still a 400, not a 500.
    r = requests.post(rt.url + "/v1/chat/completions", timeout=30,
                      data=b'{"model": "lim-model", "x": ' + b"[" * 200000 + b"]" * 200000 + b"}")
    assert r.status_code == 400
    # A long conversation has many brackets but little depth: served.
    long = {**BODY, "messages": [{"role": "user", "content": str(i)} for i in range(200)]}
    assert requests.post(rt.url + "/v1/chat/completions", json=long, timeout=30).status_code == 200
    assert served(engine) == 1


def test_connections_per_client_address_are_bounded(served_router):
    rt, engine = served_router(max_connections_per_client=3)
    held = [connect(rt.url) for _ in range(3)]
    try:
        # The three are open (the router has counted them once it has answered on one).
        held[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_status(held[0]) == 200
        for _ in range(2):      # every further connection, while the three stay open
            extra = connect(rt.url)
            assert read_status(extra) == 429
            extra.close()
        assert served(engine) == 0
    finally:
        held[1].close()
        held[2].close()
    # With two closed, this address may connect again.
    wait_until(lambda: ok(rt.url), timeout=10, what="a request once connections were freed")
    held[0].close()
    page = requests.get(rt.url + "/metrics", timeout=10).text
    assert re.search(r'^llmgw_router_connections_refused_total\{reason="per_client_limit"\} [1-9]', page, re.M)


def test_a_silent_engine_ends_the_stream_at_the_idle_timeout(engines, routers):
    silent = engines(MODEL, "lim-silent", "--ttft", "60")
    rt = routers(make_router(catalog((MODEL, ())), upstream_idle_timeout=1.0))
    rt.set_endpoints([silent.endpoint()])
    r = requests.post(rt.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30)
    # The fake sends its SSE headers at once, then nothing: the stream ends with an error event.
    assert r.status_code == 200
    assert '"code": "upstream_disconnected"' in r.text and "lim-silent: sent nothing for 1 s" in r.text
    assert rt.call(rt.router.usage_snapshot)["lim-silent"][1] == 0      # nothing left in flight


def test_an_engine_that_never_answers_a_stream_gets_504_and_is_not_retried(routers):
    # A listening socket nobody accepts on: the kernel completes the connection
    # and takes the request, and no byte ever comes back -- a wedged engine.
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(8)
    try:
        url = "http://127.0.0.1:%d" % wedged.getsockname()[1]
        rt = routers(make_router(catalog((MODEL, ())), upstream_idle_timeout=1.0))
        rt.set_endpoints([Endpoint(replica_id="lim-wedged", model=MODEL, profile="default", engine="fake",
                                   url=url, metrics_path=None)])
        r = requests.post(rt.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30)
        assert r.status_code == 504
        err = r.json()["error"]
        assert err["code"] == "upstream_timeout"
        assert err["message"] == f"replica lim-wedged of {MODEL!r} sent nothing for 1 s"
        assert rt.call(rt.router.usage_snapshot)["lim-wedged"][1] == 0
    finally:
        wedged.close()


def test_a_streaming_client_that_stops_reading_is_dropped_and_frees_the_engine(engines, routers):
    engine = engines(MODEL, "lim-stream")
    rt = routers(make_router(catalog((MODEL, ())), client_write_timeout=1.0))
    rt.set_endpoints([engine.endpoint()])
    host, port = rt.url.rsplit("/", 1)[-1].split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # fills at once when nobody reads
    s.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2_000_000, "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        inflight = lambda: rt.call(rt.router.usage_snapshot)["lim-stream"][1]     # noqa: E731
        wait_until(lambda: inflight() == 1, timeout=10, what="the stream to start")
        assert ok(rt.url)                                   # served meanwhile
        # Never read: the router gives up on this client and lets go of the engine.
        wait_until(lambda: inflight() == 0, timeout=60, what="the non-reading client to be dropped")
        assert engine.load().running == 0
    finally:
        s.close()
