"""An engine's answer read off the wire: its head held to the router's caps, its body framed and handed on.

Parsing is httptools (llhttp, the parser Node.js uses; uvicorn's too), so
what engines send is read by a complete, strict HTTP/1.1 parser rather than
code of ours. What this module adds is the bounds: an engine is a peer the
router does not trust, and its head is capped as the router's own server
caps a client's (MAX_HEADER_BYTES a line, MAX_HEADERS lines, and `MAX_HEAD`
bytes in all). Whatever breaks a bound or is not HTTP comes out of `feed` as
an UpstreamError; the connection fails the answer with it and closes.

It knows nothing of sockets or timers: the connection feeds it bytes and is
called back when the head is in and when the answer is complete.
"""
from __future__ import annotations

from collections.abc import Callable

import httptools

from ...httpserver import MAX_HEADER_BYTES, MAX_HEADERS
from .errors import OutOfBounds, UpstreamBroken, UpstreamError
from .response import Response

# An engine's whole answer head (status line and header lines) at most: a
# real one is a few hundred bytes (vLLM: status, date, server, length, type).
# The bound is also what keeps the parser cheap: httptools joins a header's
# pieces as they arrive (a `bytes +=` per read), so a line trickled in tiny
# reads costs the square of its length, and 64 KiB keeps that square small
# while leaving room for eight header lines of the longest the router takes.
MAX_HEAD = 64 * 1024


class AnswerParser:
    """Parses the answers on one connection, one at a time, into the `Response` given to `start`.

    `on_head` is called once the final head is in (not for a 1xx), and
    `on_complete` once the whole answer is, just before the response is told
    so; `keep_alive` and `body_until_close` describe the answer's framing.
    """

    __slots__ = ("response", "keep_alive", "body_until_close", "_parser", "_head_bytes", "_header_lines",
                 "_on_head", "_on_complete")

    def __init__(self, on_head: Callable[[], None], on_complete: Callable[[], None]):
        self.response: Response | None = None
        self.keep_alive = False         # the last answer allows another request on this connection
        self.body_until_close = False   # no length, not chunked: the body ends when the connection does
        self._parser = httptools.HttpResponseParser(self)
        # Bytes received since the last body byte: the head, and after it only
        # chunked framing and trailers, which are a few bytes between chunks.
        self._head_bytes = 0
        self._header_lines = 0
        self._on_head = on_head
        self._on_complete = on_complete

    def start(self, response: Response) -> None:
        """A request went out: what arrives next is its answer, read into `response`."""
        self.response = response
        self.keep_alive = False
        self.body_until_close = False
        self._head_bytes = self._header_lines = 0

    def feed(self, data: bytes) -> None:
        """Parse what arrived; UpstreamError if it is not HTTP or breaks a bound. Only while an answer is expected."""
        self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise UpstreamBroken("the engine switched protocols") from None
        except UpstreamError:
            raise                   # a bound a callback found broken (on_header, on_message_begin)
        except httptools.HttpParserError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, UpstreamError):
                raise cause from None
            raise UpstreamBroken(f"the engine's answer is not valid HTTP: {exc}") from None
        if self._head_bytes > MAX_HEAD:
            # One read more than the bound at most reaches the parser: what it
            # holds of a head (or of trailers after a chunked body) that never
            # ends stays under MAX_HEAD plus a read.
            raise OutOfBounds("headers_too_large", f"sent more than {MAX_HEAD} bytes of headers")

    # -- httptools callbacks -----------------------------------------------------------

    # The parser runs only inside `feed`, which the connection calls only with
    # a request out (`start` was called), and nothing a callback does clears
    # `self.response`: every one finds it set.

    def on_message_begin(self) -> None:
        response = self.response
        assert response is not None     # see above
        if response.complete:
            # A second answer before this one was released (an engine answering
            # twice, in the same read or before the release): it would overwrite
            # this answer's status and headers and extend its body. The error
            # stops the parser, and the connection closes.
            raise UpstreamBroken("the engine answered twice")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called per header line: no assert here or in on_body, per chunk (the
        # invariant above holds; this is the hot path and costs what it did).
        # The caps are the router's own server's (httpserver.py): a peer is held to what a client is.
        self._header_lines += 1
        if self._header_lines > MAX_HEADERS or len(name) + len(value) > MAX_HEADER_BYTES:
            raise OutOfBounds("headers_too_large", f"sent more than {MAX_HEADERS} header lines"
                              if self._header_lines > MAX_HEADERS else
                              f"sent a header line longer than {MAX_HEADER_BYTES} bytes")
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None     # see above on_message_begin
        response.status = self._parser.get_status_code()
        headers = response.headers
        if "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "") \
                and response.status not in (204, 304) and response.status >= 200:
            self.body_until_close = True
        if response.status < 200:
            # 1xx (a 100 Continue we did not ask for): the real answer follows.
            headers.clear()
            return
        self._on_head()

    def on_body(self, body: bytes) -> None:
        self._head_bytes = 0
        self.response.feed(body)  # type: ignore[union-attr]  # set: see above on_message_begin

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and response.status >= 200:
            # Asked here: llhttp answers it only inside the callback, and the
            # answer covers Connection: close and HTTP/1.0 alike.
            self.keep_alive = self._parser.should_keep_alive()
            self._on_complete()
            response.end()
