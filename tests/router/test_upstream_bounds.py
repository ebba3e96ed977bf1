"""The router's client holds every engine to bounds (router/upstream/): an engine is an untrusted peer.

Raw asyncio servers send exactly the hostile bytes each test means: a
Content-Length of 10 GB, a body without end, header lines without end, a
header value growing one small write at a time, headers that never come.
Every wait is bounded (WAIT); nothing asserts how long anything took.
"""
from __future__ import annotations

import asyncio

import pytest

from llmgwctl.httpserver import MAX_HEADER_BYTES, MAX_HEADERS
from llmgwctl.router.upstream import OutOfBounds, UpstreamTimeout

from .test_upstream import Raw, at_eof, pooled, read_request, reply, within

LIMIT = 1 << 20


async def _post(pool, url):
    return await within(pool.post(url, "/v1/x", b"{}"))


async def test_a_declared_length_past_the_limit_is_refused_before_any_body_byte_is_read():
    sent = []

    async def huge(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")
        try:
            while not writer.is_closing():
                writer.write(b" " * 65536)
                sent.append(1)
                await writer.drain()
        except ConnectionError:
            pass

    async with Raw(huge) as server, pooled() as pool:
        r = await _post(pool, server.url)
        try:
            with pytest.raises(OutOfBounds, match="10000000000 bytes") as info:
                await within(r.read(LIMIT))
            assert info.value.code == "answer_too_large"
        finally:
            r.release()
        assert pool.connections(server.url) == 0


async def test_a_body_without_a_length_is_cut_once_past_the_limit():
    async def endless(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        try:
            while True:
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass

    async with Raw(endless) as server, pooled() as pool:
        r = await _post(pool, server.url)
        try:
            with pytest.raises(OutOfBounds, match="more than the router's limit"):
                await within(r.read(LIMIT))
        finally:
            r.release()


async def test_an_answer_within_the_limit_is_read_whole():
    async def fine(reader, writer):
        while await read_request(reader):
            writer.write(reply(b"x" * 1000))

    async with Raw(fine) as server, pooled() as pool:
        r = await _post(pool, server.url)
        try:
            assert await within(r.read(1000)) == b"x" * 1000
        finally:
            r.release()


@pytest.mark.parametrize("head, match", [
    (b"".join(b"X-Pad-%d: v\r\n" % i for i in range(MAX_HEADERS + 1)), "header lines"),
    (b"X-Long: " + b"a" * MAX_HEADER_BYTES + b"\r\n", "longer than"),
])
async def test_headers_past_the_servers_own_caps_are_refused(head, match):
    async def sends(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"Content-Length: 2\r\n\r\nok")
        await at_eof(reader)

    async with Raw(sends) as server, pooled() as pool:
        with pytest.raises(OutOfBounds, match=match) as info:
            await _post(pool, server.url)
        assert info.value.code == "headers_too_large"


async def test_header_lines_without_end_are_refused_at_the_bound():
    async def endless(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        try:
            for i in range(10 ** 7):
                writer.write(b"X-Pad-%d: %s\r\n" % (i, b"a" * 100))
                if i % 64 == 0:
                    await writer.drain()
        except ConnectionError:
            pass

    async with Raw(endless) as server, pooled() as pool:
        with pytest.raises(OutOfBounds):
            await _post(pool, server.url)


async def test_a_header_value_growing_in_small_writes_is_refused_at_the_bound():
    async def grows(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Grow: ")
        try:
            while True:
                writer.write(b"a" * 64)
                await writer.drain()
                await asyncio.sleep(0)
        except ConnectionError:
            pass

    async with Raw(grows) as server, pooled() as pool:
        with pytest.raises(OutOfBounds, match="bytes of headers"):
            await within(pool.post(server.url, "/v1/x", b"{}"), 60)


async def test_headers_that_never_complete_end_at_the_headers_timeout_however_they_trickle():
    async def trickles(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        try:
            for i in range(10 ** 6):
                writer.write(b"X-%d: a\r\n" % i)
                await writer.drain()
                await asyncio.sleep(0.05)   # under the idle timeout: only the deadline ends it
        except ConnectionError:
            pass

    async with Raw(trickles) as server, pooled(headers_timeout=0.5) as pool:
        with pytest.raises(UpstreamTimeout, match="no complete headers within 0.5 s"):
            await within(pool.post(server.url, "/v1/x", b"{}", idle_timeout=1.0))
        assert pool.connections(server.url) == 0


async def test_a_whole_answer_that_never_starts_ends_at_the_headers_timeout():
    async def silent(reader, writer):
        await read_request(reader)
        await at_eof(reader)

    async with Raw(silent) as server, pooled(headers_timeout=0.3) as pool:
        with pytest.raises(UpstreamTimeout):
            await within(pool.post(server.url, "/v1/x", b"{}"))       # no idle timeout: a whole answer


async def test_trailers_without_end_after_a_chunked_body_are_refused_at_the_bound():
    async def trails(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n0\r\nX-Trailer: ")
        try:
            while True:
                writer.write(b"a" * 512)
                await writer.drain()
                await asyncio.sleep(0)
        except ConnectionError:
            pass

    async with Raw(trails) as server, pooled() as pool:
        r = await _post(pool, server.url)
        got: list[bytes] = []

        async def consume():
            async for chunk in r.chunks():
                got.append(chunk)
        try:
            with pytest.raises(OutOfBounds, match="bytes of headers"):
                await within(consume())
            assert b"".join(got) == b"hello"
        finally:
            r.release()
