"""Decoding a request body's Content-Encoding within a bound on what it inflates to.

Why not aiohttp's own decoding (`auto_decompress`, now off on llmgw's
servers, see `httpserver.server_options`): it inflates a gzip body to its
end before any size check can see it, so a 1 MB body that inflates to 1 GiB
cost a GiB of memory and seconds of the loop even though the answer was 413;
16 at once added 2.7 GB of RSS and stalled every other request.

`decode(data, encoding, limit)` inflates in two passes. The first counts what
the body inflates to, a step of `STEP` bytes at a time, keeping nothing, and
stops as soon as the count passes `limit` (BodyTooLarge): a bomb costs one
step of memory at a time, however many arrive together. Only a body known to
fit is inflated again, whole, and kept -- the same memory as an uncompressed
body of that size, which the size limit already allows.

Where. A body of at most `ON_LOOP_INPUT` compressed bytes that inflates to
less than one step is counted and inflated on the loop, where it costs less
than handing it to a thread: a compressed chat request. Everything past that
-- the rest of the count, the second pass, or both for a larger compressed
body (whose count may be all gzip members of a few bytes each, each a new
inflater, with no output between them) -- runs in the `executor` given (the
router's own thread, so bombs queue there instead of in the default executor
serve's agent also uses). zlib lets go of the GIL while it inflates, so the
loop serves others meanwhile: counting a 32 MiB inflate on the loop, even a
step at a time, cost every other request a millisecond per step, some 30 in
all for each bomb; inflating 32 MiB in one go on it cost them some 50 ms.
Compressed request bodies are rare (OpenAI SDKs send them plain), so the
thread costs almost nobody anything.

Encodings: gzip (and x-gzip), deflate (zlib-wrapped, or raw as some clients
send it), identity. Anything else, br included (brotli is not a dependency,
and its binding cannot bound its output in every version), is
UnsupportedEncoding (415), as is a list of several codings.

    BodyError               a body the server will not take as sent
     ├ BodyTooLarge         inflates past the limit (413)
     ├ UnsupportedEncoding  an encoding this module does not decode (415)
     └ BadEncoding          does not decode as its encoding says (400)

It imports nothing of ours and no HTTP stack: it sees bytes and a header value.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import zlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

# Output per inflate step of the counting pass: about a millisecond of CPU,
# the most of it a small body spends on the loop, and the memory a bomb costs
# while it is counted.
STEP = 1 << 20
# Compressed bytes a body may have and be counted on the loop: 16 KiB holds at
# most some 800 gzip members (20 bytes each at the least), which cost the
# loop about a millisecond to walk even when they inflate to nothing; a
# compressed chat request is a few KiB.
ON_LOOP_INPUT = 16 << 10


class BodyError(Exception):
    """A request body the server will not take as sent; `status` is the HTTP answer, `code` the OpenAI error code.

    Each kind names its own in its class line (the tree at the top says which is which).
    """

    status: ClassVar[int] = 400
    code: ClassVar[str] = "invalid_body"

    def __init_subclass__(cls, *, status: int, code: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.status, cls.code = status, code


class BodyTooLarge(BodyError, status=413, code="request_too_large"):
    pass


class UnsupportedEncoding(BodyError, status=415, code="unsupported_content_encoding"):
    pass


class BadEncoding(BodyError, status=400, code="invalid_body_encoding"):
    pass


_GZIP = 16 + zlib.MAX_WBITS


def _wbits(encoding: str, data: bytes) -> int | None:
    """zlib's window bits for `encoding`; None for identity; UnsupportedEncoding for the rest."""
    coding = encoding.strip().lower()
    if coding in ("", "identity"):
        return None
    if coding in ("gzip", "x-gzip"):
        return _GZIP
    if coding == "deflate":
        # RFC 9110's deflate is zlib-wrapped; some clients send the raw stream.
        # A zlib header is 0x?8 then a byte making the pair a multiple of 31.
        if len(data) >= 2 and data[0] & 0x0F == 8 and ((data[0] << 8) | data[1]) % 31 == 0:
            return zlib.MAX_WBITS
        return -zlib.MAX_WBITS
    raise UnsupportedEncoding(f"the request body's Content-Encoding {_shown(encoding)} is not supported; "
                              "send it uncompressed, or as gzip or deflate")


def _shown(encoding: str) -> str:
    # A header value is the client's text: shown shortened and printable only.
    text = "".join(c if c.isprintable() else "?" for c in encoding[:40])
    return repr(text + ("..." if len(encoding) > 40 else ""))


def _pieces(data: bytes, wbits: int, step: int) -> Iterator[bytes]:
    """The inflated body, at most `step` bytes a piece (0: each gzip member whole). BadEncoding if it is not valid."""
    rest = data
    try:
        while True:
            inflater = zlib.decompressobj(wbits)
            pending = rest
            while not inflater.eof:
                out = inflater.decompress(pending, step)
                pending = inflater.unconsumed_tail
                if out:
                    yield out
                elif not pending and not inflater.eof:
                    # All input taken, nothing more came out and the stream
                    # did not end: the body was cut short.
                    raise BadEncoding("the request body's compressed stream is truncated")
            rest = inflater.unused_data
            if not rest:
                return
            if wbits != _GZIP:
                raise BadEncoding("the request body has bytes after the end of its compressed stream")
            # gzip allows several members one after the other (`cat a.gz b.gz`).
    except zlib.error as exc:
        raise BadEncoding(f"the request body does not decode as its Content-Encoding says: {exc}") from None


async def decode(data: bytes, encoding: str | None, limit: int, *, step: int = STEP,
                 admit: Callable[[int], None] | None = None,
                 executor: concurrent.futures.Executor | None = None) -> bytes:
    """`data`, sent with Content-Encoding `encoding` (None: none), decoded; never more than `limit` bytes of it.

    BodyTooLarge past `limit` (0: no limit), found while inflating; see the
    module's docstring for what that costs, where it runs (`executor`; None:
    the loop's default) and the other errors. `admit` is told the inflated
    size once it is known and before that much is held, on the loop, so the
    caller can refuse it (by raising) within a budget of its own.
    """
    if not encoding:
        return data
    if "," in encoding:
        raise UnsupportedEncoding("the request body has several Content-Encodings; send at most one")
    wbits = _wbits(encoding, data)
    if wbits is None:
        return data
    pieces = _pieces(data, wbits, step)
    # On the loop: a small body's count, up to one step (see the module docstring).
    size, small = _count(pieces, 0, limit, step) if len(data) <= ON_LOOP_INPUT else (0, False)
    loop = asyncio.get_running_loop()
    if not small:
        size, _ = await loop.run_in_executor(executor, _count, pieces, size, limit, 0)
    if admit is not None:
        admit(size)
    if small:
        return _inflated(data, wbits)
    return await loop.run_in_executor(executor, _inflated, data, wbits)


def _count(pieces: Iterator[bytes], size: int, limit: int, until: int) -> tuple[int, bool]:
    """`size` plus what `pieces` inflate to, and whether they ended; stops once past `until` (0: never).

    BodyTooLarge as soon as the count passes `limit` (0: no limit).
    """
    for piece in pieces:
        size += len(piece)
        if limit and size > limit:
            raise BodyTooLarge(f"the request body inflates to more than the limit of {limit} bytes")
        if until and size >= until:
            return size, False
    return size, True


def _inflated(data: bytes, wbits: int) -> bytes:
    """`data` inflated whole (known to be valid and to fit)."""
    pieces = list(_pieces(data, wbits, 0))
    # One gzip member (the usual body) is one piece: kept as it is, not copied by a join.
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
