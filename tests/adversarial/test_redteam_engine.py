"""An engine's /metrics cannot hold the router's loop with interim (1xx) answers.

A hostile engine answers each scrape with 100,000 `103 Early Hints` before
its page. Every one is a complete, small HTTP message, so the header caps
(bytes and lines per message) never trip, and aiohttp, which the poller
scrapes with, reads each as a message of its own on the event loop: the
router's /healthz stalled about half a second every poll, and its memory
grew with the messages queued. Against a real standalone `llmgwctl router`
(its endpoint file naming the engine): the scrape is refused after a few
interim answers, counted as `metrics_interim` and logged, and the router
answers on. Nothing here asserts how long anything took.
"""
from __future__ import annotations

import os
import re
import socketserver
import subprocess
import sys
import threading

import requests

from tests.e2e.fleet import wait_until
from tests.router.harness import static_router_args

INTERIM = 100_000
PAGE = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


class _Hostile(socketserver.StreamRequestHandler):
    def handle(self):
        try:
            while True:
                line = self.rfile.readline()
                if not line:
                    return
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass
                path = line.split()[1]
                if path == b"/metrics":
                    self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" * INTERIM)
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(PAGE), PAGE))
                else:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                self.wfile.flush()
        except OSError:
            return      # the router closed the connection mid-flood: what it should do


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def test_interim_answers_without_end_on_metrics_are_refused_and_counted(tmp_path):
    engine = _Server(("127.0.0.1", 0), _Hostile)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{engine.server_address[1]}"
    args = static_router_args(tmp_path, "m", url, "m-1")
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        router = subprocess.Popen([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0",
                                   "--poll-interval", "0.5", *args], stdout=out, stderr=subprocess.STDOUT,
                                  env=dict(os.environ), start_new_session=True)
    try:
        found = wait_until(lambda: re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text()),
                           "the router to listen")
        base = found.group(1)

        def refused() -> float:
            page = requests.get(base + "/metrics", timeout=10).text
            hit = re.search(r'llmgw_router_engine_refusals_total\{reason="metrics_interim"\} (\S+)', page)
            return float(hit.group(1)) if hit else 0.0

        wait_until(lambda: refused() >= 2, "scrapes refused for their interim answers")
        assert "interim (1xx) answers" in log.read_text()
        assert requests.get(base + "/healthz", timeout=10).status_code == 200
    finally:
        router.kill()
        router.wait(timeout=30)
        engine.shutdown()
        engine.server_close()
