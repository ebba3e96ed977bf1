"""Issue 27, items 4 and 5: a client's input is bounded before it costs the router anything.

Against a real `llmgwctl router` process with a fake engine behind it:

- a 30 MB `model` string is a 400 that quotes at most ~100 characters of it,
  and /healthz is answered meanwhile (it used to be a 404 echoing all 30 MB,
  after 6.5 s of difflib on the loop);
- four bodies of 1,000,000 keys leave the loop free: a /healthz and a chat
  sent after them are answered before the first of them is (they used to be
  parsed on the loop, one after another, and every request waited);
- sixteen bodies inflating to just under the size limit cost the router far
  less than sixteen bodies' worth of memory (it used to hold all of them).

And, by property (hypothesis), the alias rewrite changes only the bytes of
the `model` value the parser kept -- duplicate keys, nested `model` keys, keys
spelled with escapes, any text -- end to end through a router to a capturing
upstream, too.
"""
from __future__ import annotations

import gzip
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgwctl.catalog import Catalog, Model, Profile
from llmgwctl.contracts import Endpoint
from llmgwctl.router import jsonbody
from llmgwctl.router.limits import BodyBudget, BudgetFull

from ..router.harness import make_router
from ..support import wait_until
from .test_router_inputs import fleet_files  # noqa: F401 -- the fixture: a router process and a fake engine

# -- the model name ----------------------------------------------------------------------------------


def _healthz_while(router_url: str, busy: threading.Event) -> list[int]:
    """Ask /healthz over and over until `busy` clears; the statuses it got."""
    got = []
    while busy.is_set() or not got:
        got.append(requests.get(router_url + "/healthz", timeout=60).status_code)
    return got


def test_a_30_mb_model_name_is_a_short_400_and_the_router_keeps_answering(fleet_files):  # noqa: F811
    *_, spawn = fleet_files
    router = spawn()
    name = "q" * (30 << 20)
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]}).encode()
    busy = threading.Event()
    busy.set()
    with ThreadPoolExecutor(2) as pool:
        health = pool.submit(_healthz_while, router.url, busy)
        try:
            resp = requests.post(router.url + "/v1/chat/completions", data=body, timeout=120,
                                 headers={"Content-Type": "application/json"})
        finally:
            busy.clear()
        statuses = health.result(timeout=120)
    assert resp.status_code == 400, resp.text[:300]
    assert len(resp.content) < 1000, len(resp.content)
    error = resp.json()["error"]
    assert error["code"] == "invalid_model" and "128" in error["message"], error
    assert "q" * 101 not in error["message"], error["message"]
    assert statuses and set(statuses) == {200}
    # The same with an API key: no key pattern is matched against it either.
    assert router.chat().status_code == 200


def test_errors_quote_at_most_about_100_characters_of_what_the_client_sent(fleet_files):  # noqa: F811
    *_, spawn = fleet_files
    router = spawn()
    unknown = router.chat("n" * 128)            # the longest a name can be: looked up, and not found
    assert unknown.status_code == 404 and "n" * 101 not in unknown.text and len(unknown.text) < 500
    route = requests.post(router.url + "/v1/" + "r" * 4000, json={"model": "team-a-chat"}, timeout=30)
    assert route.status_code == 404 and "r" * 101 not in route.text and len(route.text) < 500
    method = requests.put(router.url + "/v1/chat/completions?" + "m" * 4000, timeout=30)
    assert method.status_code == 405 and "m" * 101 not in method.text


# -- bodies of many values ---------------------------------------------------------------------------

def _send_raw(port: int, body: bytes, client: str = "127.0.0.1") -> socket.socket:
    """POST `body` on a connection of its own from loopback address `client`, all of it sent; the socket."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120, source_address=(client, 0))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    got = b""
    with sock:
        while b"\r\n\r\n" not in got:
            got += sock.recv(65536)
        head, _, rest = got.partition(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0].split(b":")[1])
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(head.split()[1]), rest


def test_bodies_of_a_million_keys_do_not_stall_other_requests(fleet_files):  # noqa: F811
    *_, spawn = fleet_files
    router = spawn()
    assert router.chat().status_code == 200
    # An unknown model, so each is answered by the router itself as soon as it is parsed.
    doc = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    doc.update((f"k{i}", i) for i in range(1_000_000))
    body = json.dumps(doc).encode()
    assert 16 << 20 < len(body) < 32 << 20
    done: list[str] = []     # what was answered, in the order the answers came
    lock = threading.Lock()

    def big(sock: socket.socket) -> tuple[int, bytes]:
        answer = _answer(sock)
        with lock:
            done.append("parsed")
        return answer

    # Four clients (loopback addresses of their own), so each body fits its client's large-body budget.
    socks = [_send_raw(router.port, body, f"127.0.0.{i + 2}") for i in range(4)]
    with ThreadPoolExecutor(6) as pool:
        bigs = [pool.submit(big, s) for s in socks]
        # Sent once every big body is on its way: parsed on the loop, the
        # first of them was answered before either of these could be.
        health = requests.get(router.url + "/healthz", timeout=120)
        with lock:
            done.append("healthz")
        chat = router.chat()
        with lock:
            done.append("chat")
        answers = [f.result(timeout=300) for f in bigs]
    assert health.status_code == 200 and chat.status_code == 200, chat.text
    for status, answer in answers:
        assert status == 404 and json.loads(answer)["error"]["code"] == "model_not_found", answer[:300]
    order = list(done)
    assert order.index("healthz") < order.index("parsed") and order.index("chat") < order.index("parsed"), order


def test_a_body_of_many_values_is_parsed_right_off_the_loop(fleet_files):  # noqa: F811
    """Parsed by the worker, the facts are the same: served, by alias, streamed, with bad JSON refused."""
    *_, spawn = fleet_files
    router = spawn()
    pad = list(range(60_000))
    ok = requests.post(router.url + "/v1/chat/completions", timeout=120, json={
        "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logit_bias_pad": pad})
    assert ok.status_code == 200, ok.text[:300]
    streamed = requests.post(router.url + "/v1/chat/completions", timeout=120, stream=True, json={
        "model": "team-a-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
        "pad": pad})
    assert streamed.status_code == 200 and streamed.headers["Content-Type"].startswith("text/event-stream")
    assert b"[DONE]" in streamed.content
    bad = requests.post(router.url + "/v1/chat/completions", timeout=120,
                        data=json.dumps({"model": "chat", "pad": pad}).encode()[:-1])
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    lone = requests.post(router.url + "/v1/chat/completions", timeout=120, data=json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "\ud800"}], "pad": pad}).encode())
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"], lone.text[:300]


def test_bodies_inflating_to_just_under_the_limit_are_not_all_held_at_once(fleet_files, figure):  # noqa: F811
    *_, spawn = fleet_files
    router = spawn()
    assert router.chat().status_code == 200
    pad = "a" * ((32 << 20) - 200)
    body = gzip.compress(json.dumps({"model": "team-a-chat", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2, "pad": pad}).encode())
    assert len(body) < 1 << 20
    before = router.rss_kib("VmHWM")

    def send(_: int) -> requests.Response:
        return requests.post(router.url + "/v1/chat/completions", data=body, timeout=300,
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})

    with ThreadPoolExecutor(20) as pool:
        large = [pool.submit(send, i) for i in range(16)]
        ordinary = [pool.submit(router.chat) for _ in range(4)]
        answers = [f.result(timeout=300) for f in large]
        served = [f.result(timeout=300) for f in ordinary]
    peak = router.rss_kib("VmHWM")
    # Forwarded ones get the fake engine's own answer (it takes bodies of 1 MiB: a 413 of its own).
    forwarded = [r for r in answers if "x-llmgw-replica" in r.headers]
    refused = [r for r in answers if "x-llmgw-replica" not in r.headers]
    figure(f"16 bodies inflating to 32 MiB at once: the router's peak RSS +{(peak - before) / 1024:.0f} MiB; "
           f"{len(forwarded)} forwarded, {len(refused)} refused {sorted(r.status_code for r in refused)}")
    assert [r.status_code for r in served] == [200] * 4
    assert forwarded, [r.text[:200] for r in answers]
    for r in refused:
        assert r.status_code in (429, 503), r.text[:300]
        assert r.json()["error"]["code"] == "too_many_large_bodies" and r.headers["Retry-After"]
    # Sixteen held at once were 512 MiB of bodies alone (+505 MiB of peak RSS at 48de24a).
    assert (peak - before) < 200 * 1024, f"the router's peak RSS grew by {(peak - before) // 1024} MiB"


# -- the alias rewrite -------------------------------------------------------------------------------

# Any text, lone surrogates included (they reach the body only as \u escapes).
text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=8)
plain = st.text(st.characters(codec="utf-8"), max_size=8)
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), text)
value = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.just("model"), text), inner, max_size=3)), max_leaves=10)
# How a top-level "model" key may be spelled: json.loads reads every one of them as "model".
MODEL_KEYS = ['"model"', '"mod\\u0065l"', '"\\u006d\\u006f\\u0064\\u0065\\u006c"', '"mo\\u0064el"']
ws = st.sampled_from(["", " ", "\n", "\t ", "\r\n  "])


@st.composite
def bodies(draw) -> bytes:
    """A JSON object whose last top-level `model` (perhaps one of several, by several spellings) is a string."""
    ascii_only = draw(st.booleans())
    members = draw(st.lists(st.tuples(st.one_of(text, st.just("model")), value), max_size=4))
    members.append(("model", draw(plain)))
    members.extend(draw(st.lists(st.tuples(text.filter(lambda k: k != "model"), value), max_size=3)))
    parts = []
    for key, val in members:
        spelled = draw(st.sampled_from(MODEL_KEYS)) if key == "model" else json.dumps(key, ensure_ascii=ascii_only)
        dumped = json.dumps(val, ensure_ascii=ascii_only)
        parts.append(draw(ws) + spelled + draw(ws) + ":" + draw(ws) + dumped + draw(ws))
    doc = draw(ws) + "{" + ",".join(parts) + "}" + draw(ws)
    # Unescaped, a lone surrogate is bytes no UTF-8 has; json.loads reads them (surrogatepass) all the same.
    return doc.encode("utf-8", "surrogatepass")


def _encodable(doc) -> bool:
    try:
        json.dumps(doc, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _all_text(body: bytes):
    """Every member of `body`, duplicates the parser drops included: the text the engine would get."""
    return json.loads(body, object_pairs_hook=list)


@settings(max_examples=400, deadline=None)
@given(body=bodies(), name=st.sampled_from(["canon", "qwen2.5-7b-instruct", "a/b:c@d+e"]))
@example(body=b'{"model": {"model": "x"}, "a": "\\"model\\": \\"y\\"", "model": "alias"}', name="canon")
@example(body=b'{"model": "first", "mod\\u0065l": "last"}', name="canon")
@example(body='{"é": "ü€😀", "model": "alias", "z": "\u2028"}'.encode(), name="canon")
@example(body=b'{"model":{"\xed\xa0\x80": null},"model":""}', name="canon")
def test_the_alias_rewrite_changes_only_the_model_value_the_parser_kept(body, name):
    span = jsonbody.model_span(body)
    assert span is not None
    start, end = span
    parsed = json.loads(body)
    assert json.loads(body[start:end]) == parsed["model"]
    out = jsonbody.with_model(body, span, name)
    new = json.dumps(name).encode()
    assert out[:start] == body[:start] and out[start + len(new):] == body[end:]
    assert json.loads(out) == {**parsed, "model": name}
    # Facts read as json.loads reads: the same model; a lone surrogate found exactly when there is one.
    assert jsonbody.parse(body, "model", 0).model == parsed["model"]
    # Forwarded as sent, a duplicate's lone surrogate reaches the engine too: it counts.
    assert jsonbody.lone_surrogate(body) == (not _encodable(_all_text(body)))


@settings(max_examples=200, deadline=None)
@given(doc=st.dictionaries(text, value, max_size=4))
def test_a_lone_surrogate_is_found_exactly_when_the_body_spells_one(doc):
    body = json.dumps(doc).encode()
    assert jsonbody.lone_surrogate(body) == (not _encodable(_all_text(body)))


def test_a_body_without_a_top_level_model_string_has_no_span():
    assert jsonbody.model_span(b'{"a": {"model": "x"}}') is None
    assert jsonbody.model_span(b'{}') is None
    assert jsonbody.model_span('{"model": "x"}'.encode("utf-16")) is None      # re-encoded instead


class _Capture(BaseHTTPRequestHandler):
    """An upstream that keeps the body of each request and answers a fixed chat completion."""

    protocol_version = "HTTP/1.1"
    got: list[bytes] = []
    ANSWER = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()

    def do_POST(self):  # http.server's name
        self.got.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.ANSWER)))
        self.end_headers()
        self.wfile.write(self.ANSWER)

    def do_GET(self):  # the poller's /metrics
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


_capture: dict = {}


def _capturing_router(routers):
    key = id(routers)
    if key not in _capture:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        cat = Catalog([Model(name="canon", aliases=("alias",), source="org/canon",
                             profiles=(Profile(name="default", engine="fake", gpus=0),))])
        rt = routers(make_router(cat))
        rt.set_endpoints([Endpoint(replica_id="cap", model="canon", profile="default", engine="fake",
                                   url=f"http://127.0.0.1:{server.server_address[1]}")])
        _capture.clear()
        _capture[key] = rt
    return _capture[key]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies())
def test_an_alias_reaches_the_engine_byte_identical_but_for_its_name(routers, body):
    if not _encodable(_all_text(body)):
        return                              # a lone surrogate by alias is a 400 (test_router_inputs)
    rt = _capturing_router(routers)
    aliased = jsonbody.with_model(body, jsonbody.model_span(body), "alias")
    start, end = jsonbody.model_span(aliased)
    before = len(_Capture.got)
    resp = requests.post(rt.url + "/v1/chat/completions", data=aliased, timeout=30,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text[:300]
    wait_until(lambda: len(_Capture.got) > before, timeout=10, what="the body at the upstream")
    sent = _Capture.got[-1]
    assert sent == aliased[:start] + b'"canon"' + aliased[end:]


def test_the_large_body_budget_is_per_client_and_in_all_and_given_back():
    budget = BodyBudget(large=10, per_client=100, total=150)
    assert budget.take("a", 9) == 0                 # small: not counted
    assert budget.take("a", 60) == 60
    with pytest.raises(BudgetFull) as full:
        budget.take("a", 50)
    assert full.value.per_client
    assert budget.take("b", 80) == 80
    with pytest.raises(BudgetFull) as full:
        budget.take("c", 20)
    assert not full.value.per_client
    budget.give_back("a", 60)
    budget.give_back("b", 80)
    assert budget.held() == 0 and budget.take("c", 100) == 100
