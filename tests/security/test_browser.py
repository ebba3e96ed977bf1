"""Web pages cannot drive llmgw: a real `llmgwctl serve` on loopback, met as a browser would meet it.

A page of another site makes the operator's browser send what it likes, with
the headers only a browser sets (Origin, Sec-Fetch-*) and a Host of the
page's choosing once its name resolves here (DNS rebinding). Each attack is
refused before anything runs, nothing is written or started, and the
clients that are not browsers -- the CLI, agents, curl -- go on as before.
The control API's own bounds are here too: a trickled body is cut, and
every refusal on either port is JSON with an `X-Request-Id`.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import pytest
import requests

from llmgwctl.httporigin import AllowedHosts, BrowserGuard, check_names, check_origins, same_origin, split_host
from tests.e2e.fleet import Fleet, wait_until

MODEL = "br-model"
CATALOG = f"""\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: {MODEL}
    profiles: [{{name: cpu, engine: fake, gpus: 0}}]
"""
APP = "https://app.example.test"          # allowed on the router (--cors-origin)
ADMIN = "https://admin.example.test"      # allowed on the control API (--control-cors-origin)
EVIL = "https://evil.example"
NAMED = "gw.example.test"                 # --allowed-host
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ID = re.compile(r"[0-9a-f]{16}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser-fleet")
    fleet = Fleet(root)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1", "--cors-origin", APP, "--control-cors-origin", ADMIN,
                          "--allowed-host", NAMED)
        wait_until(lambda: fleet.ready(MODEL), f"{MODEL} ready")
        yield fleet
    finally:
        fleet.close_waiting()


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def json_error(resp: requests.Response, status: int) -> dict:
    """The error of `resp`, checked to be `status`, in the JSON error shape and carrying a request id."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    assert ID.fullmatch(resp.headers.get("X-Request-Id", "")), resp.headers
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"], error
    return error


def attack_catalog(marker) -> str:
    # What a page would send: a catalog engine running a shell command, and a model using it.
    return f"""\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: br-pwned
    profiles: [{{name: cpu, engine: pwn, gpus: 0}}]
engines:
  pwn:
    command: ["sh", "-c", "touch {marker}; exec sleep 600"]
    health: /health
"""


def test_a_foreign_page_cannot_apply_a_catalog_nor_run_a_command(fleet, tmp_path):
    marker = tmp_path / "ran"
    body = json.dumps({"filename": "pwn.yaml", "content": attack_catalog(marker)})
    before = sorted(os.listdir(fleet.catalogs))
    url = fleet.control + "/api/v1/catalog"
    # fetch(url, {mode: "no-cors", method: "POST", headers: {"Content-Type": "text/plain"}, body}):
    # a "simple request", sent without a preflight, with the page's Origin.
    simple = {"Content-Type": "text/plain;charset=UTF-8", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    error = json_error(requests.post(url, data=body, headers={**simple, "Origin": EVIL}, timeout=10), 403)
    assert error["code"] == "cors_origin_not_allowed" and "--control-cors-origin" in error["message"]
    # A page on another port of this machine (a dev server) is another origin too.
    local = f"http://127.0.0.1:{port(fleet.control) + 1}"
    json_error(requests.post(url, data=body, headers={**simple, "Origin": local}, timeout=10), 403)
    # The router's allowed origin is not the control API's.
    json_error(requests.post(url, data=body, headers={**simple, "Origin": APP}, timeout=10), 403)
    # A browser that sent no Origin still says where the request came from.
    error = json_error(requests.post(url, data=body, headers=simple, timeout=10), 403)
    assert error["code"] == "cross_site_request"
    # A form post (navigation) carries its Origin as well.
    json_error(requests.post(url, data=body, headers={"Content-Type": "text/plain", "Origin": "null",
                                                      "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"},
                             timeout=10), 403)
    # Past the browser checks (its own origin, or no browser at all), a body that
    # is not sent as JSON is still refused: only application/json needs a preflight.
    own = fleet.control
    for headers in ({"Content-Type": "text/plain", "Origin": own, "Sec-Fetch-Site": "same-origin"},
                    {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        error = json_error(requests.post(url, data=body, headers=headers, timeout=10), 415)
        assert "application/json" in error["message"], headers
    # Nothing was written, nothing is placed, nothing ran.
    assert sorted(os.listdir(fleet.catalogs)) == before
    assert "br-pwned" not in {m["name"] for m in fleet.status()["models"]}
    # The CLI's way (requests' json=) is taken as ever: a dry run plans it.
    ok = requests.post(url + "?dry_run=1", json={"filename": "pwn.yaml", "content": CATALOG.replace(MODEL, "br-dry")},
                       timeout=30)
    assert ok.status_code == 200 and ok.json()["dry_run"] is True, ok.text
    assert sorted(os.listdir(fleet.catalogs)) == before and not marker.exists()


def test_a_foreign_host_is_refused_on_both_ports_so_dns_rebinding_reads_nothing(fleet):
    for base, path in ((fleet.control, "/api/v1/status"), (fleet.control, "/api/v1/catalog"),
                       (fleet.control, "/metrics"), (fleet.router, "/v1/models"), (fleet.router, "/metrics")):
        # After rebinding, the page is "same-origin" with its own name: the Host says which.
        host = f"rebind.evil.example:{port(base)}"
        for extra in ({}, {"Sec-Fetch-Site": "same-origin"}, {"Origin": f"http://{host}"}):
            resp = requests.get(base + path, headers={"Host": host, **extra}, timeout=10)
            error = json_error(resp, 403)
            assert error["code"] == "host_not_allowed" and "--allowed-host" in error["message"], (path, extra)
            assert MODEL not in resp.text and "replicas" not in resp.text
    error = json_error(requests.post(fleet.router + "/v1/chat/completions", json=CHAT,
                                     headers={"Host": "rebind.evil.example"}, timeout=10), 403)
    assert error["code"] == "host_not_allowed"
    # The names a server is reached by on this machine, and the one the operator named.
    for host in ("localhost", "127.0.0.1", "[::1]", "some-host", "app.localhost", NAMED, NAMED.upper() + "."):
        for base, path in ((fleet.control, "/api/v1/status"), (fleet.router, "/v1/models")):
            resp = requests.get(base + path, headers={"Host": f"{host}:{port(base)}"}, timeout=10)
            assert resp.status_code == 200, (host, path, resp.text[:300])


def test_a_cross_site_chat_is_refused_on_the_router_and_clients_without_a_browser_are_served(fleet):
    url = fleet.router + "/v1/chat/completions"
    body = json.dumps(CHAT)
    simple = {"Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    error = json_error(requests.post(url, data=body, headers={**simple, "Origin": EVIL}, timeout=10), 403)
    assert error["code"] == "cors_origin_not_allowed" and "--cors-origin" in error["message"]
    assert json_error(requests.post(url, data=body, headers=simple, timeout=10), 403)["code"] == "cross_site_request"
    # An <img src=.../v1/models> of another site: a no-cors GET.
    json_error(requests.get(fleet.router + "/v1/models", headers={"Sec-Fetch-Site": "same-site",
                                                                  "Sec-Fetch-Mode": "no-cors"}, timeout=10), 403)
    # curl and the SDKs send none of these headers: served as before.
    assert requests.post(url, json=CHAT, timeout=30).status_code == 200
    assert requests.post(url, data=body, headers={"Content-Type": "text/plain"}, timeout=30).status_code == 200


def test_an_allowed_origin_gets_cors_on_its_port_only(fleet):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    r = requests.options(fleet.router + "/v1/chat/completions", headers={**ask, "Origin": APP}, timeout=10)
    assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == ask["Access-Control-Request-Headers"]
    r = requests.post(fleet.router + "/v1/chat/completions", json=CHAT,
                      headers={"Origin": APP, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}, timeout=30)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == APP
    assert "X-Request-Id" in r.headers["Access-Control-Expose-Headers"]
    # A preflight from any other origin: refused, and names no origin.
    for origin in (EVIL, ADMIN):
        r = requests.options(fleet.router + "/v1/chat/completions", headers={**ask, "Origin": origin}, timeout=10)
        assert json_error(r, 403)["code"] == "cors_origin_not_allowed"
        assert "Access-Control-Allow-Origin" not in r.headers
    # The control API's allowed origin, on the control API.
    r = requests.options(fleet.control + "/api/v1/status", headers={**ask, "Origin": ADMIN}, timeout=10)
    assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == ADMIN
    r = requests.get(fleet.control + "/api/v1/status", headers={"Origin": ADMIN}, timeout=10)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ADMIN
    r = requests.options(fleet.control + "/api/v1/catalog", headers={**ask, "Origin": APP}, timeout=10)
    assert json_error(r, 403)["code"] == "cors_origin_not_allowed"
    assert "Access-Control-Allow-Origin" not in r.headers


def test_the_console_is_its_own_origin_and_a_link_to_it_opens(fleet):
    for host in ("127.0.0.1", "localhost"):
        own = f"http://{host}:{port(fleet.control)}"
        page = requests.get(own + "/ui/", headers={"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"},
                            timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()
        # What the page's own fetch sends.
        same = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors", "Referer": own + "/ui/"}
        r = requests.get(own + "/api/v1/status", headers=same, timeout=10)
        assert r.status_code == 200 and MODEL in {m["name"] for m in r.json()["models"]}
        r = requests.get(own + "/api/v1/status", headers={**same, "Origin": own}, timeout=10)
        assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    # A person following a link to the console from another site's page.
    r = requests.get(fleet.control + "/ui/", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
                                                      "Sec-Fetch-Dest": "document"}, timeout=10)
    assert r.status_code == 200


def raw(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port(url)), timeout=10)


def read_response(s: socket.socket, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """(status, headers lowercased, body) of the one response on `s` (Content-Length framed)."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed without a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        assert chunk, "closed inside the response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed(s: socket.socket, timeout: float = 30) -> bool:
    """Whether the server closes `s` within `timeout`, whatever it still sends first."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def test_a_trickled_body_is_cut_with_408_and_the_api_answers_meanwhile(fleet):
    s = raw(fleet.control)
    s.sendall(b"POST /api/v1/catalog HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000\r\n\r\n")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(1.0):
            try:
                s.send(b" ")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        # The API goes on answering while the body trickles.
        t0 = time.monotonic()
        answered = 0
        while time.monotonic() - t0 < 5:
            assert requests.get(fleet.control + "/healthz", timeout=5).status_code == 200
            answered += 1
            time.sleep(0.5)
        assert answered >= 5
        status, headers, body = read_response(s, timeout=90)
        stop.set()
        assert status == 408, body
        assert ID.fullmatch(headers["x-request-id"])
        assert "did not arrive" in json.loads(body)["error"]["message"]
        assert closed(s), "the connection stayed open after the 408"
    finally:
        stop.set()
        s.close()
    # A long-poll carries no body, and waits as long as it asks to.
    r = requests.get(fleet.control + "/api/v1/watch/catalog", params={"after": 1, "timeout": 1}, timeout=30)
    assert r.status_code == 200
    assert requests.get(fleet.control + "/healthz", timeout=5).status_code == 200


def test_refusals_on_both_ports_are_json_with_a_request_id(fleet):
    for base in (fleet.control, fleet.router):
        assert json_error(requests.get(base + "/no/such/route", timeout=10), 404)
        assert json_error(requests.post(base + "/no/such/route", json={}, timeout=10), 404)
    error = json_error(requests.put(fleet.control + "/api/v1/status", json={}, timeout=10), 405)
    assert "GET" in error["message"]
    r = requests.delete(fleet.control + "/api/v1/catalog", timeout=10)
    assert json_error(r, 405) and "POST" in r.headers["Allow"]
    assert json_error(requests.get(fleet.router + "/v1/chat/completions", timeout=10), 405)
    assert json_error(requests.get(fleet.control + "/ui/nope.js", timeout=10), 404)
    # A client's own id is kept.
    r = requests.get(fleet.control + "/nowhere", headers={"X-Request-Id": "mine-42"}, timeout=10)
    assert r.status_code == 404 and r.headers["X-Request-Id"] == "mine-42"
    # Too large: refused by its Content-Length, before the body is read.
    for base, path, size in ((fleet.control, "/api/v1/catalog", 5 * 1024 * 1024),
                             (fleet.router, "/v1/chat/completions", 33 * 1024 * 1024)):
        s = raw(base)
        try:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {size}\r\n\r\n{{".encode())
            status, headers, body = read_response(s)
        finally:
            s.close()
        assert status == 413 and ID.fullmatch(headers["x-request-id"]), (base, body)
        assert headers["content-type"].startswith("application/json") and json.loads(body)["error"]["message"]


@pytest.mark.parametrize("request_bytes", [
    b"GET /healthz HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: 1\r\n\r\n",
    b"POST /api/v1/wake HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
], ids=["bad version", "bad header", "bad chunk"])
def test_what_aiohttps_parser_refuses_is_json_with_a_request_id_on_both_ports(fleet, request_bytes):
    for base in (fleet.control, fleet.router):
        s = raw(base)
        try:
            s.sendall(request_bytes)
            status, headers, body = read_response(s)
        finally:
            s.close()
        assert status == 400, (base, body)
        assert ID.fullmatch(headers["x-request-id"]), headers
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error


# -- the rules themselves -----------------------------------------------------------------------------


def test_host_names_that_rebinding_cannot_produce_pass_and_named_ones_are_added():
    guard = BrowserGuard(server="test", allowed_hosts=("llm.example.com", "*.corp.example"))
    passes = ("127.0.0.1", "127.0.0.1:8081", "10.1.2.3:80", "[::1]:8081", "[fe80::1]", "localhost:8080",
              "LOCALHOST", "x", "gpu-box-7:8080", "app.localhost:3000", "llm.example.com", "llm.example.com.:443",
              "a.corp.example", "b.a.corp.example:1")
    refused = ("evil.example", "evil.example:8081", "127.0.0.1.nip.io", "localhost.evil.example",
               "corp.example", "example.com", "[::1", "host:port", "host:99999999", ":8080", "")
    assert [h for h in passes if not guard.host_allowed(h)] == []
    assert [h for h in refused if guard.host_allowed(h)] == []
    assert AllowedHosts(["*"]).allows("anything.example")
    assert split_host("[::1]:8081") == ("::1", 8081) and split_host("Example.COM.") == ("example.com", None)


def test_a_request_is_its_own_origin_only_on_the_host_and_port_it_was_sent_to():
    assert same_origin("http://127.0.0.1:8081", "127.0.0.1:8081")
    assert same_origin("https://llm.example.com", "llm.example.com")          # behind a TLS proxy
    assert same_origin("http://[::1]:8081", "[::1]:8081")
    assert not same_origin("http://127.0.0.1:8080", "127.0.0.1:8081")
    assert not same_origin("http://localhost:8081", "127.0.0.1:8081")
    assert not same_origin("null", "127.0.0.1:8081")
    assert not same_origin("http://127.0.0.1:8081", None)
    guard = BrowserGuard(server="test")
    assert guard.refusal("GET", {"Host": "127.0.0.1:1", "Origin": "http://127.0.0.1:1"}) is None
    assert guard.refusal("POST", {"Host": "127.0.0.1:1", "Origin": "http://127.0.0.1:2"})[0] == "cors_origin_not_allowed"
    assert guard.refusal("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}) is None
    assert guard.refusal("POST", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})[0] == "cross_site_request"
    assert guard.refusal("GET", {"Sec-Fetch-Site": "same-origin"}) is None
    assert guard.refusal("POST", {}) is None


def test_a_server_bound_beyond_loopback_checks_host_once_names_are_given():
    assert BrowserGuard.for_bind("127.0.0.1", server="t").check_host
    assert BrowserGuard.for_bind(None, server="t").check_host
    assert not BrowserGuard.for_bind("0.0.0.0", server="t").check_host
    named = BrowserGuard.for_bind("0.0.0.0", server="t", allowed_hosts=("llm.example.com",))
    assert named.check_host and named.host_allowed("llm.example.com") and not named.host_allowed("evil.example")
    bound = BrowserGuard.for_bind("gw.example.com", server="t", allowed_hosts=("other.example.com",))
    assert bound.host_allowed("gw.example.com:8080") and not bound.host_allowed("evil.example")


def test_options_are_checked_as_a_browser_spells_them():
    assert check_origins(["https://a.example/", "http://localhost:3000", "*"], "--cors-origin") == (
        "https://a.example", "http://localhost:3000", "*")
    for bad in ("a.example", "https://a.example/path", "ftp://a.example", "https://"):
        with pytest.raises(ValueError, match="--cors-origin"):
            check_origins([bad], "--cors-origin")
    with pytest.raises(ValueError, match="every web page"):
        check_origins(["*"], "--control-cors-origin", allow_any=False)
    assert check_names(["llm.example.com", "*.corp.example", "*"], "--allowed-host")
    for bad in ("http://llm.example.com", "llm.example.com:8080", "", "*.", "a b"):
        with pytest.raises(ValueError, match="--allowed-host"):
            check_names([bad], "--allowed-host")


def test_a_body_framing_error_a_handler_lets_through_is_a_specific_400_not_a_500():
    # aiohttp's C parser answers a bad chunk in the same read as the headers
    # itself (the parametrized test above); one that reaches a handler reading
    # the body arrives as RequestPayloadError, which aiohttp hands to the same
    # seam as a 500. Driven at that seam, as no client can time the split.
    from types import SimpleNamespace

    from aiohttp.http_exceptions import TransferEncodingError
    from aiohttp.test_utils import make_mocked_request
    from aiohttp.web_protocol import RequestPayloadError

    from llmgwctl.httpserver import _handle_error

    request = make_mocked_request("POST", "/v1/chat/completions", headers={"X-Request-Id": "frame-1"},
                                  writer=SimpleNamespace(output_size=0))
    for cause in (TransferEncodingError("bad chunk size"), None):
        exc = RequestPayloadError("payload error")
        exc.__cause__ = cause
        resp = _handle_error(None, request, 500, exc)
        assert resp.status == 400 and resp.headers["X-Request-Id"] == "frame-1"
        error = json.loads(resp.body)["error"]
        assert error["code"] == "invalid_body_framing" and "chunked" in error["message"], error
    # And a plain bug stays a 500, in JSON with an id.
    resp = _handle_error(None, request, 500, KeyError("x"))
    assert resp.status == 500 and resp.headers["X-Request-Id"] == "frame-1"
    assert json.loads(resp.body)["error"]["code"] == "internal_error"
