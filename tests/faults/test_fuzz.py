"""Scenario 7: malformed requests against a real router and a real controller, driven by hypothesis.

Requests are written on raw sockets, so they can be what no HTTP client
library would send: odd methods, paths with traversal and bad escapes, header
lines without colons or with control bytes, lying Content-Lengths, bodies
that are not JSON, JSON of the wrong shape, and chat requests with every field
of the wrong type. Some clients hang up as soon as the headers arrive.

Targets: the router of `llmgwctl serve`, its control API, and a standalone
`llmgwctl router`. The bound: no 5xx except 503/504 (no capacity), no
process dies, and once the fuzzing stops no request is counted in flight.
Hypothesis runs a fixed number of examples; every socket has a timeout.
"""
import json
import re
import socket
import string
import time

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.fleet import wait_until

from .load import router_inflight

EXAMPLES = 1000
# The run's bound in time as well as count: 1,000 examples take 10-20 s here;
# past this budget (a server answering nothing but timeouts) the remaining
# examples are not sent, and the checks after the run say what went wrong.
# Well inside the scenario's 60 s cut, so those checks get to run.
BUDGET = 30.0
# Long enough for a reply from the paced fake engine, short enough that a
# request the server rightly keeps waiting (a body shorter than its declared
# length) costs the run little.
READ_TIMEOUT = 1.5

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    aliases: [chat]
    profiles: [{name: cpu, engine: fake, gpus: 0, args: [--tokens-per-second, "200"]}]
"""

ROUTER_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/healthz", "/metrics",
                "/v1/", "/v1", "/", "/v1/chat/completions/../../healthz", "/v1/%2e%2e/%2e%2e/etc/passwd"]
CONTROL_PATHS = ["/api/v1/status", "/api/v1/catalog", "/api/v1/catalog?dry_run=1", "/api/v1/agents/n1/report",
                 "/api/v1/agents/fuzz/report", "/api/v1/agents/n1/desired?after=x&timeout=0",
                 "/api/v1/watch/endpoints?after=abc&timeout=0", "/api/v1/watch/endpoints?after=1&timeout=-5",
                 "/api/v1/watch/catalog?timeout=nan", "/api/v1/wake", "/healthz", "/readyz", "/metrics", "/api/v1/"]

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                      st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
weird = st.one_of(json_value, st.sampled_from([-1, 0, 2**63, 1e308, "3", "", [], {}, None, True]))

chat = st.fixed_dictionaries(
    {"model": st.one_of(st.sampled_from(["talk", "chat", "talk", "chat", "nope", ""]), weird)},
    optional={"messages": st.one_of(st.just([{"role": "user", "content": "hi"}]), weird,
                                    st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]), weird,
                                                             max_size=3), max_size=3)),
              "prompt": weird, "input": weird, "stream": weird,
              "max_tokens": st.one_of(st.integers(-5, 40), weird), "temperature": weird, "n": weird,
              "stop": weird, "stream_options": weird})
# Well-formed requests too, streaming or not, so hang-ups land mid-stream and mid-generation.
good_chat = st.fixed_dictionaries({"model": st.sampled_from(["talk", "chat"]),
                                   "messages": st.just([{"role": "user", "content": "hi"}]),
                                   "stream": st.booleans(), "max_tokens": st.integers(1, 60)})
control_body = st.one_of(
    st.fixed_dictionaries({"filename": st.text(max_size=12).filter(lambda f: f != "models.yaml"),
                           "content": st.one_of(st.text(max_size=60), weird)}),
    st.fixed_dictionaries({"model": weird}),
    st.fixed_dictionaries({"node": weird, "gpus": weird, "replicas": weird, "pools": weird, "engines": weird}),
    json_value)
body = st.one_of(chat.map(json.dumps), good_chat.map(json.dumps), control_body.map(json.dumps), st.binary(max_size=200),
                 st.just('{"model": "talk", "messages": [' * 300), st.just(b"\xff\xfe{}"))

token = st.text(alphabet=string.ascii_letters + string.digits + "-_!#$%&'*+.^`|~", min_size=1, max_size=20)
header_line = st.one_of(
    st.tuples(token, st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40))
    .map(lambda kv: f"{kv[0]}: {kv[1]}"),
    st.sampled_from(["NoColonHere", ": empty-name", "Content-Type: application/json; charset=utf-16",
                     "Content-Type: text/plain", "Content-Encoding: gzip", "Content-Encoding: deflate",
                     "Transfer-Encoding: chunked",
                     "Authorization: Bearer nonsense", "Accept-Encoding: br", "Expect: 100-continue",
                     "X-Dup: 1", "Host:", "Connection: keep-alive, upgrade", "Upgrade: websocket",
                     "X-Bin: \x01\x7f", "X" * 9000 + ": long"]),
)
anything = st.fixed_dictionaries({
    "target": st.sampled_from(["router", "standalone", "control"]),
    "method": st.one_of(st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]), token),
    "path": st.one_of(st.sampled_from(ROUTER_PATHS + CONTROL_PATHS),
                      st.tuples(st.sampled_from(ROUTER_PATHS + CONTROL_PATHS),
                                st.text(alphabet=string.printable.strip() + "%", max_size=30)).map("".join)),
    # Mostly well framed, so most requests reach the handlers rather than the HTTP parser.
    "headers": st.one_of(st.just([]), st.lists(header_line, max_size=4)),
    "body": body,
    "length": st.sampled_from(["exact"] * 12 + ["none", "garbage", "negative", "twice", "more"]),
    "hang_up": st.booleans(),
})
# Half the examples are a chat request framed as a client library would send
# it, good or with fields of the wrong type, so many reach an engine and back.
chat_request = st.fixed_dictionaries({
    "target": st.sampled_from(["router", "standalone"]), "method": st.just("POST"),
    "path": st.sampled_from(["/v1/chat/completions", "/v1/completions"]), "headers": st.just([]),
    "body": st.one_of(good_chat, good_chat, chat).map(json.dumps), "length": st.just("exact"), "hang_up": st.booleans(),
})
request = st.one_of(anything, chat_request)


def raw(port: int, req: dict) -> int | None:
    """Send one request as bytes; the status code, or None when the server closed or kept waiting."""
    data = req["body"].encode("utf-8", "surrogatepass") if isinstance(req["body"], str) else req["body"]
    path = "".join(c if 32 < ord(c) < 127 else "%%%02X" % (ord(c) & 0xFF) for c in req["path"])
    lines = [f"{req['method']} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *req["headers"]]
    declared = {"exact": str(len(data)), "garbage": "12abc", "negative": "-1", "twice": str(len(data)),
                "more": str(len(data) + 10), "none": None}[req["length"]]
    if declared is not None:
        lines.append(f"Content-Length: {declared}")
    if req["length"] == "twice":
        lines.append(f"Content-Length: {len(data) + 1}")
    if req["length"] == "exact" and "application/json" not in str(req["headers"]):
        lines.append("Content-Type: application/json")
    wire = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass") + data
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT) as sock:
        try:
            sock.sendall(wire)
            got = b""
            while b"\r\n" not in got:
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                got += chunk
            if not req["hang_up"]:  # else: gone as soon as the status line is in, mid-stream or not
                while b"\r\n\r\n" not in got:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    got += chunk
        except (TimeoutError, ConnectionError):
            return None
    match = re.match(rb"HTTP/1\.[01] (\d{3})", got)
    assert match, got[:200]
    return int(match.group(1))


def test_fuzzed_requests_get_no_5xx_crash_nothing_and_leak_no_inflight_count(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    fleet.start_controller()
    fleet.start_agent("n1", "none")
    wait_until(lambda: fleet.ready("talk"), "talk ready")
    standalone = fleet.start_router("--cold-timeout", "2")
    ports = {"router": fleet.router_port, "control": fleet.control_port,
             "standalone": int(standalone.rsplit(":", 1)[1])}
    statuses: dict[int | str | None, int] = {}
    bad: list[tuple[int, dict]] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(req=request)
    def fuzz(req):
        if time.monotonic() - started > BUDGET:
            statuses["not sent: over budget"] = statuses.get("not sent: over budget", 0) + 1
            return
        status = raw(ports[req["target"]], req)
        statuses[status] = statuses.get(status, 0) + 1
        if status is not None and status >= 500 and status not in (503, 504):
            bad.append((status, req))
            # Per example, so hypothesis shrinks the request that failed, not a later one.
            raise AssertionError(f"{status} for {req}")

    started = time.monotonic()

    def tally() -> str:
        answered = sum(n for s, n in statuses.items() if isinstance(s, int))
        counts = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items(), key=lambda kv: str(kv[0]).zfill(3)))
        return (f"{sum(statuses.values())} fuzzed requests in {took:.0f} s, {answered} answered ({counts}); "
                f"bad 5xx {len(bad)}")
    try:
        fuzz()
    except BaseException:
        took = time.monotonic() - started
        figure(tally() + " -- FAILED")
        raise
    took = time.monotonic() - started

    processes = {"controller": fleet.controller, "agent": fleet.agents["n1"], "standalone router": fleet.routers[0]}
    dead = [name for name, proc in processes.items() if proc.poll() is not None]
    assert dead == [], f"died while fuzzed: {dead}"
    # Hung-up clients cancel their requests asynchronously: give the counts a moment to come down.
    wait_until(lambda: all(r["inflight"] == 0 for r in fleet.replicas()) and router_inflight(standalone) == 0,
               "no request in flight in either router", timeout=30)
    # The controller's loops survived what its API was fed, not only its HTTP server.
    passes = fleet.status()["passes"]
    wait_until(lambda: fleet.status()["passes"] > passes, "the reconciler still making passes")
    for url in (fleet.router, standalone):
        ok = requests.post(url + "/v1/chat/completions", timeout=30,
                           json={"model": "chat", "messages": [{"role": "user", "content": "still there?"}]})
        assert ok.status_code == 200, ok.text
    figure(tally() + "; then no process dead, 0 in flight, reconciler passing, both routers serving")
