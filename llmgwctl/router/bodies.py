"""A proxied request's body, read as it came: within its size, its time and the large-body budget, inflated.

`BodyReader.read` is the request path's first read of the body
(`request.RequestPath`), after the target, the key and the rate were
checked: a declared length past `max_body_bytes` is refused before a byte
is read; what is read is charged to the large-body budget
(`limits.BodyBudget`) as it grows; a compressed body is inflated (httpbody)
on one thread of its own, stopping at the limit. What it charged is given
back once the request ends (`release`). It must not know what the body says:
parsing it is the intake's (`intake.Intake`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures

from aiohttp import web

from .. import httpbody
from ..allocator import Trimmer
from . import errors
from .call import Call, Refused
from .config import RouterConfig
from .limits import BodyBudget, BudgetFull

__all__ = ["BodyReader"]


class BodyReader:
    """Request bodies read within their limits (`read`), each one's budget charge let go when it ends (`release`)."""

    def __init__(self, config: RouterConfig, *, bodies: BodyBudget, trimmer: Trimmer):
        self._config = config
        self._bodies = bodies
        self._trimmer = trimmer
        # Compressed bodies past a small one are inflated here (httpbody): one
        # thread, so gzip bombs queue behind each other and take at most one
        # core, and never the default executor serve's agent also uses.
        # Made on the first compressed body, let go with the app.
        self._inflater: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Let the inflating thread go (the app stops)."""
        inflater, self._inflater = self._inflater, None
        if inflater is not None:
            inflater.shutdown(wait=False, cancel_futures=True)

    def release(self, call: Call) -> None:
        """Give back what `call`'s body was charged (the request ended, however it ended)."""
        self._bodies.give_back(call.request.remote or "?", call.held)
        self._trimmer.released(call.held)

    async def read(self, call: Call) -> bytes:
        """The body as sent, decoded; its size (compressed and inflated) at most max_body_bytes.

        aiohttp does not decompress (see httpserver.server_options): a gzip
        body is inflated here by httpbody, which stops at the limit as it
        inflates.
        """
        request, cfg = call.request, self._config
        limit = cfg.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise Refused(errors.too_large(limit))
        client = request.remote or "?"
        try:
            if length is not None:
                # Declared: charged before a byte of it is held.
                self._hold(call, client, length)
            if request.content.is_eof():
                data = await request.read()      # already buffered: the usual small request
            else:
                # wait_for, not asyncio.timeout: Python 3.10 is supported. Only
                # bodies still arriving pay for it.
                data = await asyncio.wait_for(_read_whole(request, limit), cfg.body_timeout)
            if length is None:
                self._hold(call, client, len(data))
            encoding = request.headers.get("Content-Encoding")
            if encoding is not None:
                if self._inflater is None:
                    self._inflater = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmgw-inflate")
                data = await httpbody.decode(data, encoding, limit, executor=self._inflater,
                                             admit=lambda size: self._hold(call, client, size))
            return data
        except web.HTTPRequestEntityTooLarge:
            self._trimmer.released(limit)     # what aiohttp read before it stopped, let go
            raise Refused(errors.too_large(limit)) from None
        except httpbody.BodyTooLarge:
            raise Refused(errors.response(
                413, f"the request body inflates to more than the router's limit of {limit} bytes",
                "invalid_request_error", "request_too_large")) from None
        except httpbody.BodyError as exc:
            raise Refused(errors.response(exc.status, str(exc), "invalid_request_error", exc.code)) from None
        except web.RequestPayloadError:
            # Bad chunked framing, or a body shorter than its Content-Length.
            raise Refused(errors.response(
                400, "the request body is not framed as its headers say (chunked encoding or Content-Length)",
                "invalid_request_error", "invalid_body")) from None
        except asyncio.TimeoutError:
            raise Refused(errors.response(
                408, f"the request body did not arrive within {cfg.body_timeout:g} s", "invalid_request_error",
                "request_timeout", headers={"Connection": "close"})) from None

    def _hold(self, call: Call, client: str, size: int) -> None:
        """Charge a body of `size` bytes to the large-body budget (raised past what was charged); Refused when full."""
        if size <= call.held:
            return
        budget = self._bodies
        budget.give_back(client, call.held)
        call.held = 0
        try:
            call.held = budget.take(client, size)
        except BudgetFull as full:
            raise Refused(errors.large_bodies_busy(full.per_client, full.limit)) from None


async def _read_whole(request: web.BaseRequest, limit: int) -> bytes:
    """A body still arriving, read to its end (at most `limit` bytes): its pieces joined once.

    Not `request.read()`: that grows a bytearray piece by piece and copies
    it into `bytes` at the end, one more copy of the whole body in one go on
    the loop (about 20 ms for 30 MB on a loaded core, where pages come from
    fresh mappings: llmgwctl.allocator), and it raises the stream's buffer to
    the body limit first, so a fast sender's megabytes arrive as one piece
    the loop copies whole again. Read as it comes, a body is taken in the
    transport's own pieces, with turns of the loop between them, and joined
    once.
    """
    content = request.content
    pieces: list[bytes] = []
    size = 0
    while True:
        piece = await content.readany()
        if not piece:
            break
        size += len(piece)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
