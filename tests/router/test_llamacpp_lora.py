"""Requests to llama.cpp endpoints of a base with adapters: the body's `lora` member written last, by the endpoint's
number for the adapter, every adapter off for the base; the client's own `lora` reaches nothing it did not name."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from llmgwctl.catalog import Adapter, Model, Profile
from llmgwctl.contracts import Endpoint
from llmgwctl.router.auth import KeyFileWatcher, hash_key
from llmgwctl.router.loraselect import with_member

from .harness import catalog, make_router

BASE = Model(name="base", source="/m/base.gguf", profiles=(Profile(name="cpu", engine="llamacpp", gpus=0),),
             adapters=(Adapter("sql", "/a/sql.gguf", aliases=("sql-lora",)), Adapter("chat", "/a/chat.gguf")))
PLAIN = Model(name="plain", source="/m/plain.gguf", profiles=(Profile(name="cpu", engine="llamacpp", gpus=0),))


class Recorder(BaseHTTPRequestHandler):
    """Stands in for llama-server at the edge: answers as it does (the model named by its --alias, whatever the
    request said) and keeps each body it was sent, as bytes."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append(body)     # type: ignore[attr-defined]
        answer = json.dumps({"id": "c1", "object": "chat.completion", "model": self.server.alias,  # type: ignore[attr-defined]
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def llama():
    servers = []

    def serve(alias: str) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        server.bodies, server.alias = [], alias     # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def endpoint(server: ThreadingHTTPServer, rid: str, model: str = "base", **ids: int) -> Endpoint:
    return Endpoint(rid, model, "cpu", "llamacpp", f"http://127.0.0.1:{server.server_address[1]}",
                    adapters=frozenset(ids), adapter_ids=ids)


def post(url: str, raw: bytes, key: str | None = None) -> requests.Response:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return requests.post(url + "/v1/chat/completions", data=raw, headers=headers, timeout=30)


def test_a_member_is_spliced_in_last_and_nothing_before_it_changes():
    assert with_member(b'{"model":"m", "lora": [{"id":0,"scale":1}]}  \n', "lora", b"[]") == \
        b'{"model":"m", "lora": [{"id":0,"scale":1}],"lora":[]}  \n'
    assert with_member(b"{ }", "lora", b"[]") == b'{"lora":[]}'
    assert with_member(b'{"a":"}"}', "lora", b"[]") == b'{"a":"}","lora":[]}'
    # UTF-16 is re-encoded whole as UTF-8, the member set in the document.
    assert json.loads(with_member('{"model":"m","lora":[1]}'.encode("utf-16"), "lora", b"[]")) == \
        {"model": "m", "lora": []}


def test_an_adapter_goes_to_its_holder_as_the_base_with_its_number_and_comes_back_as_asked(routers, llama):
    one, two = llama("base"), llama("base")
    rt = routers(make_router(catalog(BASE, PLAIN)))
    # The two replicas number their adapters differently (a replacement launched with another list).
    rt.set_endpoints([endpoint(one, "r1", sql=1, chat=0), endpoint(two, "r2", chat=2)])
    asked = post(rt.url, b'{"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}]}')
    assert asked.status_code == 200, asked.text
    assert asked.headers["x-llmgw-replica"] == "r1" and asked.json()["model"] == "sql-lora"
    sent = one.bodies[-1]
    assert sent == b'{"model": "base", "messages": [{"role": "user", "content": "hi"}],"lora":[{"id":1,"scale":1}]}'
    # By its own name: the answer, which names the base, names the adapter.
    for _ in range(6):
        answer = post(rt.url, b'{"model":"chat","messages":[]}')
        assert answer.json()["model"] == "chat"
    got = {json.loads(b)["lora"][0]["id"] for b in one.bodies[1:] + two.bodies}
    assert got == {0, 2}, "each endpoint is told its own number for the adapter"
    # A model without adapters: the body goes on as sent, lora and all (nothing of ours to reach)...
    plain, dropped = llama("plain"), llama("plain")
    rt.set_endpoints([endpoint(one, "r1", sql=1, chat=0), endpoint(plain, "p1", model="plain")])
    raw = b'{"model":"plain","messages":[],"lora":[{"id":0,"scale":1}]}'
    assert post(rt.url, raw).status_code == 200 and plain.bodies[-1] == raw
    # ...unless its engine says it holds some: launched with an adapter the catalog dropped since.
    rt.set_endpoints([endpoint(dropped, "p2", model="plain", old=0)])
    assert post(rt.url, raw).status_code == 200
    assert dropped.bodies[-1] == raw[:-1] + b',"lora":[{"id":0,"scale":0}]}'


@pytest.mark.parametrize("lora", [
    b'"lora":[{"id":0,"scale":1}]',
    b'"lora":[{"id":1,"scale":5},{"id":0,"scale":1}]',
    b'"lor\\u0061":[{"id":0,"scale":1}]',          # the same key, spelled with an escape
    b'"lora":{"id":0}',
])
def test_a_key_for_the_base_cannot_reach_an_adapter_through_its_own_lora_member(tmp_path, routers, llama, lora):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: base-only, sha256: {hash_key('sk-base')}, models: [base], rpm: 6000}}\n"
                    f"  - {{name: sql-team, sha256: {hash_key('sk-sql')}, models: [sql], rpm: 6000}}\n")
    one = llama("base")
    rt = routers(make_router(catalog(BASE)))
    rt.call(KeyFileWatcher(keys, rt.router.set_api_keys).load_initial)
    rt.set_endpoints([endpoint(one, "r1", sql=1, chat=0)])
    raw = b'{"model":"base","messages":[],' + lora + b"}"
    assert post(rt.url, raw, "sk-base").status_code == 200
    sent = one.bodies[-1]
    # What llama-server reads (its parser, like Python's, keeps the last of duplicate keys): every adapter off.
    assert sent == raw[:-1] + b',"lora":[{"id":0,"scale":0}]}'
    assert json.loads(sent)["lora"] == [{"id": 0, "scale": 0}]
    # A key for one adapter that names another in `lora` gets the one it may use.
    raw = b'{"model":"sql","messages":[],' + lora.replace(b'"id":1', b'"id":9') + b"}"
    assert post(rt.url, raw, "sk-sql").status_code == 200
    assert json.loads(one.bodies[-1])["lora"] == [{"id": 1, "scale": 1}]
    # And the adapter itself stays out of a base-only key's reach by name.
    assert post(rt.url, b'{"model":"sql","messages":[]}', "sk-base").status_code == 403


def test_a_static_llamacpp_endpoint_numbers_its_adapters_in_the_order_listed():
    from llmgwctl.router.static import parse_endpoints

    (ep,) = parse_endpoints({"endpoints": [{"model": "base", "url": "http://h:1", "adapters": ["chat", "sql-lora"]}]},
                            catalog(BASE), "eps.yaml")
    # As llama-server was started: --lora chat.gguf --lora sql.gguf.
    assert ep.engine == "llamacpp" and dict(ep.adapter_ids) == {"chat": 0, "sql": 1}
