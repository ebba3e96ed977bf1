"""Issue 13, the router's side: what a stranger can send it, against a real `llmgwctl router` process.

Each scenario fails on b616774: a gzip bomb inflated to its end after its 413
(RSS of the router process, measured); a lone surrogate sent by alias was a
500; malformed HTTP was answered in plain text quoting the client's bytes;
`..`, encoded dots and absolute-form targets were forwarded to the engine; a
404's "did you mean" named models the key may not use; the `--endpoints`
file was read once.
"""
from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from llmgwctl.router.auth import hash_key

from ..procs import kill_group
from ..router.harness import _readline
from ..support import wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: team-a-chat
    aliases: [chat]
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: team-b-chat
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
KEY = "sk-team-a-secret"


class RouterProcess:
    """`llmgwctl router --endpoints --catalogs` as a user runs it; its stderr kept line by line."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc = proc
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def rss_kib(self, field: str = "VmRSS") -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    def chat(self, model: str = "team-a-chat", **kw) -> requests.Response:
        return requests.post(self.url + "/v1/chat/completions", timeout=30, **kw,
                             json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.fixture
def fleet_files(tmp_path, engines):
    """A catalog dir, an endpoint file pointing both models at one fake engine, and `spawn(*extra)` for routers."""
    engine = engines("team-a-chat", "e1")
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "models.yaml").write_text(CATALOG)
    eps = tmp_path / "eps.yaml"
    eps.write_text(f"endpoints:\n  - {{model: team-a-chat, url: '{engine.url}', id: e1}}\n"
                   f"  - {{model: team-b-chat, url: '{engine.url}', id: e1b}}\n")
    started: list[subprocess.Popen] = []

    def spawn(*extra: str) -> RouterProcess:
        proc = subprocess.Popen([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0",
                                 "--endpoints", str(eps), "--catalogs", str(tmp_path / "cat"), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        line = _readline(proc, 15)
        return RouterProcess(proc, line.rsplit(" ", 1)[-1].strip())

    yield tmp_path, eps, engine, spawn
    for proc in started:
        kill_group(proc)


def raw_exchange(port: int, wire: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send bytes, read the answer to its end (the server closes after an error): status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(wire)
        got = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
            head, sep, rest = got.partition(b"\r\n\r\n")
            if sep:
                headers = dict(line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ": " in line)
                length = int(headers.get("Content-Length", "-1"))
                if 0 <= length <= len(rest):
                    break
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    return int(lines[0].split()[1]), headers, body


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    assert status == expected, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), (headers, body[:300])
    doc = json.loads(body)
    assert set(doc) == {"error"} and {"message", "type", "code"} <= set(doc["error"]), doc
    return doc["error"]


# -- bodies bounded while decoding --------------------------------------------------------------

def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """A gzip body of about 1 MB that inflates to `inflated` bytes of zeros, built without holding them."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    parts = [comp.compress(zeros) for _ in range(inflated >> 20)]
    parts.append(comp.flush())
    return b"".join(parts)


def test_sixteen_gzip_bombs_at_once_cost_the_router_little_memory_and_others_are_served(fleet_files, figure):
    *_, spawn = fleet_files
    router = spawn()
    assert router.chat().status_code == 200                 # warm: the pool and parser are set up
    bomb = gzip_bomb()
    assert len(bomb) < 2 << 20
    before = router.rss_kib("VmHWM")

    def send_bomb(_: int) -> requests.Response:
        return requests.post(router.url + "/v1/chat/completions", data=bomb, timeout=120,
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})

    with ThreadPoolExecutor(20) as pool:
        bombs = [pool.submit(send_bomb, i) for i in range(16)]
        # Ordinary requests while the bombs are being refused: all answered.
        ordinary = [pool.submit(router.chat) for _ in range(8)]
        answers = [f.result(timeout=180) for f in bombs]
        served = [f.result(timeout=180) for f in ordinary]
    peak = router.rss_kib("VmHWM")
    figure(f"16 gzip bombs ({len(bomb) >> 10} KiB each, 1 GiB inflated) at once: the router's peak RSS "
           f"+{(peak - before) / 1024:.1f} MiB; {sum(r.status_code == 200 for r in served)}/8 ordinary requests served")
    for resp in answers:
        assert resp.status_code == 413, resp.text[:300]
        assert resp.json()["error"]["code"] == "request_too_large"
    assert [r.status_code for r in served] == [200] * 8
    # Peak RSS over the whole storm, not after it: aiohttp's own decoding
    # inflated every bomb to its gigabyte before the 413 (2.7 GB for 16).
    assert (peak - before) < 100 * 1024, f"16 bombs raised the router's peak RSS by {(peak - before) // 1024} MiB"


def test_compressed_bodies_within_the_limit_are_served_and_the_rest_refused_in_json(fleet_files):
    *_, spawn = fleet_files
    router = spawn("--max-body-bytes", "4096")
    doc = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    ok = requests.post(router.url + "/v1/chat/completions", data=gzip.compress(doc), timeout=30,
                       headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert ok.status_code == 200, ok.text
    assert requests.post(router.url + "/v1/chat/completions", data=zlib.compress(doc), timeout=30,
                         headers={"Content-Encoding": "deflate"}).status_code == 200
    # Past the limit once inflated, though the compressed body is tiny.
    big = gzip.compress(json.dumps({"model": "chat", "prompt": "x" * 10000}).encode())
    assert len(big) < 4096
    for data, encoding, status, code in [(big, "gzip", 413, "request_too_large"),
                                         (b"\x1f\x8bnot gzip at all", "gzip", 400, "invalid_body_encoding"),
                                         (gzip.compress(doc)[:-12], "gzip", 400, "invalid_body_encoding"),
                                         (doc, "br", 415, "unsupported_content_encoding"),
                                         (doc, "gzip, gzip", 415, "unsupported_content_encoding")]:
        resp = requests.post(router.url + "/v1/chat/completions", data=data, timeout=30,
                             headers={"Content-Encoding": encoding})
        assert resp.status_code == status, (encoding, resp.status_code, resp.text[:200])
        assert resp.json()["error"]["code"] == code


# -- every error OpenAI-shaped --------------------------------------------------------------------

def test_a_lone_surrogate_sent_by_alias_is_a_400(fleet_files):
    *_, spawn = fleet_files
    router = spawn()
    body = b'{"model": "chat", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    resp = requests.post(router.url + "/v1/chat/completions", data=body, timeout=30,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_json"
    # A surrogate pair is text: served.
    paired = body.replace(b"\\ud800", b"\\ud83d\\ude00")
    assert requests.post(router.url + "/v1/chat/completions", data=paired, timeout=30).status_code == 200


MARK = b"XYZZY\x7f<script>"
# Each a request aiohttp's parser refuses; each carries MARK, which no answer may echo.
MALFORMED = {
    "bad request line": b"GET /v1/models" + MARK + b"\r\n\r\n",
    "bad method": b"G\x01T" + MARK + b" /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad version": b"GET /v1/models HTTP/9." + MARK + b"\r\nHost: x\r\n\r\n",
    "header without colon": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + MARK + b"\r\n\r\n",
    "control byte in a header": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00" + MARK + b"\r\n\r\n",
    "space before colon": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A" + MARK + b" : 1\r\n\r\n",
    "header line too long": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + MARK + b"a" * 9000 + b"\r\n\r\n",
    "request line too long": b"GET /v1/models?" + MARK + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "too many headers": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-%d: %s\r\n" % (i, MARK) for i in range(200)) + b"\r\n",
    "two content lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                           b"Content-Length: 3" + MARK + b"\r\n\r\n{}",
    "bad content length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1" + MARK + b"\r\n\r\n{}",
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"zz" + MARK + b"\r\n{}\r\n0\r\n\r\n",
    "chunked and length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                          b"Content-Length: 5\r\n\r\n2\r\n{}\r\n0\r\n\r\n" + MARK,
    "bad transfer encoding": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + MARK +
                             b"\r\n\r\n{}",
    "not http at all": b"\x16\x03\x01\x02\x00" + MARK + b"\r\n\r\n",
}


def test_malformed_http_gets_openai_shaped_json_that_echoes_nothing(fleet_files):
    *_, spawn = fleet_files
    router = spawn()
    wrong = {}
    for kind, wire in sorted(MALFORMED.items()):
        status, headers, body = raw_exchange(router.port, wire)
        try:
            assert 400 <= status < 500, (status, body[:300])
            error = assert_openai_error(status, headers, body, status)
            assert b"XYZZY" not in body and b"script" not in body, body
            assert error["type"] == "invalid_request_error", error
        except (AssertionError, ValueError) as exc:
            wrong[kind] = str(exc)[:300]
    assert wrong == {}
    # The router is still serving.
    assert router.chat().status_code == 200


def test_an_unexpected_error_in_a_handler_is_a_500_in_json_logged_with_its_traceback(caplog):
    """The last resort, on the shared server hardening (the router and the control API both install it)."""
    import asyncio

    from aiohttp import web

    from llmgwctl.httpserver import bound_port, json_errors, server_options

    async def broken(request):
        raise KeyError("a bug of ours")

    async def main():
        app = web.Application()
        app.router.add_get("/boom", broken)
        runner = web.AppRunner(app, access_log=None, **server_options())
        await runner.setup()
        json_errors(runner.server)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            return await asyncio.to_thread(raw_exchange, bound_port(runner),
                                           b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        finally:
            await runner.cleanup()

    with caplog.at_level("ERROR", logger="llmgw.httpserver"):
        status, headers, body = asyncio.run(main())
    error = assert_openai_error(status, headers, body, 500)
    assert error["code"] == "internal_error" and "a bug of ours" not in body.decode()
    (record,) = [r for r in caplog.records if r.name == "llmgw.httpserver"]
    assert record.exc_info and record.exc_info[0] is KeyError


# -- paths normalised ------------------------------------------------------------------------------

def test_only_normalised_paths_under_v1_reach_an_engine(fleet_files):
    *_, spawn = fleet_files
    router = spawn()
    body = b'{"model": "team-a-chat", "prompt": "x", "max_tokens": 2}'
    for target in [b"/v1/../../admin/shutdown", b"/v1/completions/../../admin/shutdown", b"/v1/./completions",
                   b"/v1/%2e%2e/%2e%2e/admin/shutdown", b"/v1/%2E%2e/completions", b"/v1/x%2f..%2fcompletions",
                   b"/v1//completions", b"/v1/x\\..\\completions",
                   b"http://127.0.0.1:%d/v1/completions" % router.port, b"http://evil.example/v1/completions"]:
        wire = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (target, len(body), body))
        status, headers, answer = raw_exchange(router.port, wire)
        error = assert_openai_error(status, headers, answer, 400)
        assert error["code"] in ("invalid_path", "invalid_url"), (target, error)
        assert "x-llmgw-replica" not in headers, target      # no engine was asked
    # A normal target, with a query string, still goes through.
    ok = requests.post(router.url + "/v1/completions?trace=1", data=body, timeout=30)
    assert ok.status_code == 200 and ok.headers["x-llmgw-replica"] == "e1"


# -- item 12: suggestions, the endpoint file ---------------------------------------------------------

def test_a_404_suggests_only_models_the_key_may_use(fleet_files):
    tmp, *_, spawn = fleet_files
    keys = tmp / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: team-a, sha256: {hash_key(KEY)}, models: ['team-a-*', 'chat*'], rpm: 6000}}\n")
    router = spawn("--api-keys", str(keys))
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = router.chat("team-a-chatt", headers=auth)
    assert resp.status_code == 404, resp.text
    message = resp.json()["error"]["message"]
    assert "team-a-chat" in message and "team-b-chat" not in message, message
    resp = requests.get(router.url + "/v1/models/chatt", headers=auth, timeout=30)
    assert resp.status_code == 404 and "team-b" not in resp.text, resp.text


def test_the_endpoints_file_is_followed_and_a_bad_edit_keeps_the_last_good(fleet_files, engines):
    tmp, eps, first, spawn = fleet_files
    second = engines("team-a-chat", "e2")
    router = spawn()
    assert router.chat().headers["x-llmgw-replica"] == "e1"
    new = tmp / "eps.yaml.new"
    new.write_text(f"endpoints:\n  - {{model: team-a-chat, url: '{second.url}', id: e2}}\n")
    new.rename(eps)                                         # an editor's or config manager's save
    wait_until(lambda: router.chat().headers.get("x-llmgw-replica") == "e2", timeout=15,
               what="the edited endpoint file in force")
    eps.write_text("endpoints:\n  - {model: no-such-model, url: 'http://127.0.0.1:1'}\n")
    wait_until(lambda: any("keeping the endpoints in force" in line for line in router.log), timeout=15,
               what="the rejected edit logged")
    assert any("no-such-model" in line for line in router.log)
    assert router.chat().headers.get("x-llmgw-replica") == "e2"     # the last good list stays
    assert router.proc.poll() is None
