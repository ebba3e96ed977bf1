"""An HTTP server on 127.0.0.1 that counts what reaches it, for the tests and the benches alike.

Where a hostile engine's redirects point: the router must follow none, so a
test or bench asserts that no request reached it. Only the standard library
here: `bench/` imports this without the test extra.
"""
from __future__ import annotations

import http.server
import threading


class CountingTarget:
    """Answers every GET or POST with an empty 200 and records its path in `hits`."""

    def __init__(self) -> None:
        hits: list[str] = []
        self.hits = hits

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
