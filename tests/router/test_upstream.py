"""The router's HTTP/1.1 client (router/upstream/) against real servers on loopback.

Engines that behave are aiohttp apps; engines that misbehave are raw asyncio
servers, so the bytes on the wire are exactly the ones each test means. Every
wait is bounded by WAIT, and nothing asserts how long anything took: where time
has to pass (idle timeouts, keep-alive expiry) the margins are wide, or the
pool's clock is faked.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import struct

import pytest
import trustme
from aiohttp import web

from llmgwctl.router.upstream import (
    BadEndpointURL,
    ConnectFailed,
    Pool,
    Target,
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
    parse_target,
)
from llmgwctl.router.upstream.outgoing import JOIN_BELOW, write_request

from ..support import FakeClock, until

# Long enough for a loaded 2-core machine to do anything these tests ask;
# a test that waits this long has failed.
WAIT = 5.0


async def within(aw, seconds: float = WAIT):
    return await asyncio.wait_for(aw, seconds)


@contextlib.asynccontextmanager
async def pooled(**kw):
    pool = Pool(**kw)
    try:
        yield pool
    finally:
        await pool.close()


async def fetch(pool: Pool, url: str, path: str = "/v1/x", body: bytes = b"{}", **kw) -> tuple[int, bytes]:
    """One whole request: (status, body), the answer released."""
    r = await within(pool.post(url, path, body, **kw))
    try:
        return r.status, await within(r.read())
    finally:
        r.release()


class Engine:
    """An aiohttp app on loopback that counts the connections it accepts.

    `transports` holds the connection each request came on, so a test can see
    from the server's side that the client closed it.
    """

    def __init__(self, tls=None, **routes):
        self.routes = routes        # path without the leading slash -> handler
        self.tls = tls              # an ssl.SSLContext: serve https
        self.accepted = 0
        self.transports: list = []

    async def __aenter__(self) -> Engine:
        app = web.Application()
        for name, handler in self.routes.items():
            app.router.add_post("/" + name, self._track(handler))
        # A short shutdown: a test that failed may leave a handler waiting.
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()

        def accept():
            self.accepted += 1
            return self.runner.server()
        self.server = await asyncio.get_running_loop().create_server(accept, "127.0.0.1", 0, ssl=self.tls)
        scheme = "https" if self.tls else "http"
        self.url = "%s://127.0.0.1:%d" % (scheme, self.server.sockets[0].getsockname()[1])
        return self

    def _track(self, handler):
        async def tracked(request):
            self.transports.append(request.transport)
            return await handler(request)
        return tracked

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.runner.cleanup()
        await self.server.wait_closed()


class Raw:
    """A server speaking raw bytes: `handle(reader, writer)` runs per connection and closes it when it means to."""

    def __init__(self, handle):
        self.handle = handle
        self.accepted = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Raw:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = "http://127.0.0.1:%d" % self.port
        return self

    async def _serve(self, reader, writer) -> None:
        self.accepted += 1
        self.writers.append(writer)
        await self.handle(reader, writer)

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """(head, body) of the next request on a connection, or None at its end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = re.search(rb"(?im)^content-length: *(\d+)\r$", head)
    return head, await reader.readexactly(int(length.group(1)) if length else 0)


async def at_eof(reader: asyncio.StreamReader) -> bool:
    """Reads until the client closes the connection (a FIN or a reset), then True."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass
    return True


def reply(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status, len(body), extra, body)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()



# -- 1. Content-Length, keep-alive ---------------------------------------------------------


async def test_content_length_reply_and_sequential_requests_share_one_connection():
    async def answer(request):
        n = (await request.json())["n"]
        return web.Response(status=201, body=b'{"n": %d}' % n, content_type="application/json",
                            headers={"X-Engine-Thing": "Kept-Case"})

    async with Engine(answer=answer) as engine, pooled() as pool:
        for n in range(5):
            r = await within(pool.post(engine.url, "/answer", b'{"n": %d}' % n))
            try:
                assert r.status == 201
                assert r.headers["x-engine-thing"] == "Kept-Case"       # names lower-cased, values not
                assert r.headers["content-type"] == "application/json"
                assert r.headers["content-length"] == str(len(b'{"n": %d}' % n))
                assert all(name == name.lower() for name in r.headers)
                assert await within(r.read()) == b'{"n": %d}' % n
                assert r.complete
            finally:
                r.release()
            assert pool.connections(engine.url) == 1
        assert engine.accepted == 1, "keep-alive: five requests in a row should share one connection"
        assert len({id(t) for t in engine.transports}) == 1


# -- 2. chunked streams --------------------------------------------------------------------

PARTS = [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n", b"data: [DONE]\n\n"]


async def test_chunked_stream_arrives_chunk_by_chunk_and_the_connection_is_reused():
    may_finish = asyncio.Event()
    last_written = asyncio.Event()

    async def stream(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(PARTS[0])
        await may_finish.wait()         # until the client has seen the first chunk
        for part in PARTS[1:]:
            await asyncio.sleep(0.01)   # separate reads on the client's side, most likely
            await resp.write(part)
        last_written.set()
        await resp.write_eof()
        return resp

    async def plain(request):
        return web.Response(body=b"plain")

    async with Engine(stream=stream, plain=plain) as engine, pooled() as pool:
        r = await within(pool.post(engine.url, "/stream", b"{}"))
        assert r.status == 200
        assert r.headers["transfer-encoding"] == "chunked"

        async def consume():
            got = []
            async for chunk in r.chunks():
                assert chunk
                if not got:
                    # The server is holding the rest until it hears of this one.
                    assert not last_written.is_set()
                    may_finish.set()
                got.append(chunk)
            return got

        try:
            got = await within(consume())
        finally:
            r.release()
        assert b"".join(got) == b"".join(PARTS)
        assert await fetch(pool, engine.url, "/plain") == (200, b"plain")
        assert engine.accepted == 1
        assert pool.connections(engine.url) == 1


# -- 3. answers that end their connection ---------------------------------------------------


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 5\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\n",
], ids=["connection-close", "http-1.0"])
async def test_answer_that_ends_its_connection_is_read_and_the_connection_not_reused(head):
    client_closed = []

    async def last_answer(reader, writer):
        await read_request(reader)
        # The server leaves the socket open: only the answer's header (or its
        # version) says the connection is not kept alive.
        writer.write(head + b"bye!!")
        client_closed.append(await within(at_eof(reader)))

    async with Raw(last_answer) as server, pooled() as pool:
        for _ in range(2):
            assert await fetch(pool, server.url) == (200, b"bye!!")
            assert pool.connections(server.url) == 0
        assert server.accepted == 2
        await until(lambda: len(client_closed) == 2, "the server to see both connections closed")


# -- 4. a body that ends with the connection --------------------------------------------------


async def test_body_without_length_or_chunking_ends_with_the_connection():
    async def until_close(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        for part in (b"first part, ", b"second part, ", b"the end"):
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(part)
        await writer.drain()
        writer.close()

    async with Raw(until_close) as server, pooled() as pool:
        assert await fetch(pool, server.url) == (200, b"first part, second part, the end")
        assert pool.connections(server.url) == 0


async def test_body_until_close_cut_by_the_idle_timeout_is_a_timeout_not_complete():
    async def stalls(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nfirst part, ")
        await at_eof(reader)

    async with Raw(stalls) as server, pooled() as pool:
        r = await within(pool.post(server.url, "/v1/x", b"{}", idle_timeout=0.3))
        try:
            # Read only once the timeout has closed the connection: the close
            # the pool made itself must not pass for the body's end.
            await until(lambda: pool.connections(server.url) == 0, "the idle timeout to close the connection")
            with pytest.raises(UpstreamTimeout):
                await within(r.read())
        finally:
            r.release()


async def test_204_without_length_has_an_empty_body_and_keeps_the_connection():
    async def no_content(reader, writer):
        while await read_request(reader):
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    async with Raw(no_content) as server, pooled() as pool:
        for _ in range(3):
            assert await fetch(pool, server.url) == (204, b"")
        assert server.accepted == 1


# -- 5. connecting -----------------------------------------------------------------------------


async def test_refused_port_is_connect_failed():
    # Bound but not listening: the kernel refuses connections to it, and no
    # one else can take the port meanwhile.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        async with pooled() as pool:
            with pytest.raises(ConnectFailed):
                await within(pool.post(url, "/v1/x", b"{}"))
            assert pool.connections(url) == 0       # a failed connect leaves no count behind


# A URL no request could go to is the configuration's fault, not the engine's:
# BadEndpointURL, which is not an UpstreamError, so nothing treats it as an
# engine down (the router checks URLs with parse_target when endpoints are set).
@pytest.mark.parametrize("url, match", [
    ("ftp://127.0.0.1:1", "not an http"),
    ("http://:8000", "no host"),
    ("http://127.0.0.1:99999", "not a usable endpoint URL"),
    ("http://127.0.0.1:port", "not a usable endpoint URL"),
    ("http://[::1", "not a usable endpoint URL"),
])
async def test_a_url_that_cannot_be_an_engines_is_a_configuration_error_before_anything_is_sent(url, match):
    with pytest.raises(BadEndpointURL, match=match):
        parse_target(url)
    assert not issubclass(BadEndpointURL, UpstreamError)
    async with pooled() as pool:
        with pytest.raises(BadEndpointURL, match=match):
            await pool.post(url, "/v1/x", b"{}")
        assert pool.connections(url) == 0


def test_a_target_is_parsed_once_into_its_named_parts():
    assert parse_target("https://engine.example:8443/prefix/") == Target(
        host="engine.example", port=8443, host_header=b"engine.example:8443", path_prefix=b"/prefix", tls=True)
    assert parse_target("http://10.0.0.5") == Target("10.0.0.5", 80, b"10.0.0.5", b"", False)


# Connect timeout: not tested. Nothing on loopback reliably leaves connect()
# hanging (with a full listen backlog, Linux may still complete the handshake
# from the client's side), and a blackhole address depends on the network the
# tests run in.


# -- 6. connections the engine closes ------------------------------------------------------------


async def test_idle_connection_closed_by_the_engine_is_replaced_transparently():
    async def one_per_connection(reader, writer):
        await read_request(reader)
        # Keep-alive by every header, and then closed anyway, as an engine whose
        # own keep-alive timeout ran out.
        writer.write(reply(b"answered"))
        await writer.drain()
        writer.close()

    async with Raw(one_per_connection) as server, pooled() as pool:
        assert await fetch(pool, server.url) == (200, b"answered")
        assert await fetch(pool, server.url) == (200, b"answered")
        assert server.accepted == 2


async def test_kept_alive_connection_closed_as_the_request_arrives_is_retried_on_a_fresh_one():
    async def drops_the_second(reader, writer):
        assert await read_request(reader)
        writer.write(reply(b"first"))
        if await read_request(reader):
            # The race the pool must absorb: the request went out on a
            # kept-alive connection just as the engine closed it.
            writer.close()

    async with Raw(drops_the_second) as server, pooled() as pool:
        assert await fetch(pool, server.url) == (200, b"first")
        assert await fetch(pool, server.url) == (200, b"first")     # not ConnectFailed
        assert server.accepted == 2





async def hangs_up(reader, writer):
    await read_request(reader)
    writer.close()


async def resets(reader, writer):
    await read_request(reader)
    reset(writer)


async def half_head(reader, writer):
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
    await writer.drain()
    writer.close()


async def garbage(reader, writer):
    await read_request(reader)
    writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    await at_eof(reader)


# Engines that fail a request on a fresh connection before its headers are in.
# No byte of an answer came from the first two, so the request may go to
# another endpoint (ConnectFailed), and a fresh connection failing is not
# retried: the engine is down. The other two did answer, so not ConnectFailed:
# the module's docstring says UpstreamBroken when "the engine sent something
# that is not HTTP" -- before the headers too.
@pytest.mark.parametrize("engine, error, match", [
    (hangs_up, ConnectFailed, "closed the connection"),
    (resets, ConnectFailed, None),
    (half_head, UpstreamBroken, "before the answer's headers were complete"),
    (garbage, UpstreamBroken, "not valid HTTP"),
], ids=["closed", "reset", "closed mid-headers", "not HTTP"])
async def test_failure_before_the_headers_says_whether_a_retry_is_safe(engine, error, match):
    async with Raw(engine) as server, pooled() as pool:
        with pytest.raises(error, match=match):
            await within(pool.post(server.url, "/v1/x", b"{}"))
        assert server.accepted == 1
        assert pool.connections(server.url) == 0


# -- 7, 8. answers that break off, or are not HTTP ----------------------------------------------


# A body delimited by the connection's end (no length) is cut short only by a
# reset -- a crash, not the end of the body; a close ends it (section 4).
@pytest.mark.parametrize("head, cut", [
    (b"Content-Length: 100\r\n", lambda writer: writer.close()),
    (b"Content-Length: 100\r\n", reset),
    (b"", reset),
], ids=["length, close", "length, reset", "until close, reset"])
async def test_a_body_cut_short_is_broken(head, cut):
    headers_seen = asyncio.Event()

    async def half(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n" + head + b"\r\n" + b"x" * 50)
        await writer.drain()
        await headers_seen.wait()   # an RST could discard the headers before the client read them
        cut(writer)

    async with Raw(half) as server, pooled() as pool:
        r = await within(pool.post(server.url, "/v1/x", b"{}"))
        headers_seen.set()
        try:
            assert r.status == 200
            with pytest.raises(UpstreamBroken):
                await within(r.read())
        finally:
            r.release()
        assert pool.connections(server.url) == 0


async def test_close_mid_chunked_stream_is_broken_after_the_chunks_that_came():
    client_has_first = asyncio.Event()

    async def half_stream(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await client_has_first.wait()
        writer.write(b"6\r\n world\r\n")
        await writer.drain()
        writer.close()

    async with Raw(half_stream) as server, pooled() as pool:
        r = await within(pool.post(server.url, "/v1/x", b"{}"))
        chunks = r.chunks()
        try:
            assert await within(chunks.__anext__()) == b"hello"
            client_has_first.set()
            got = b""
            with pytest.raises(UpstreamBroken):
                async for chunk in chunks:
                    got += chunk
            assert got == b" world"
        finally:
            await chunks.aclose()
            r.release()


async def test_bytes_on_an_idle_connection_make_it_unusable():
    released = asyncio.Event()

    async def talks_out_of_turn(reader, writer):
        first = server.accepted == 1
        while await read_request(reader):
            writer.write(reply(b"ok"))
            if first:
                await released.wait()
                writer.write(reply(b"unasked"))

    # A keep-alive far longer than the test, so the pool's sweep is not what closes it.
    async with Raw(talks_out_of_turn) as server, pooled(keepalive_timeout=60.0) as pool:
        assert await fetch(pool, server.url) == (200, b"ok")
        assert pool.connections(server.url) == 1
        released.set()
        await until(lambda: pool.connections(server.url) == 0, "the connection that talked out of turn to close")
        assert await fetch(pool, server.url) == (200, b"ok")
        assert server.accepted == 2


async def test_a_second_answer_in_the_same_read_is_not_part_of_the_first():
    async def answers_twice(reader, writer):
        while await read_request(reader):
            writer.write(reply(b"ok") + reply(b"unasked", status=b"500 Oops"))

    async with Raw(answers_twice) as server, pooled() as pool:
        r = await within(pool.post(server.url, "/v1/x", b"{}"))
        try:
            assert await within(r.read()) == b"ok"
            assert r.status == 200
            assert r.headers["content-length"] == "2"
        finally:
            r.release()
        assert pool.connections(server.url) == 0        # it cannot be trusted with another request
        assert await fetch(pool, server.url) == (200, b"ok")
        assert server.accepted == 2


# -- 9. idle timeout -------------------------------------------------------------------------


async def test_engine_silent_before_the_headers_is_a_timeout():
    client_closed = asyncio.Event()

    async def silent(reader, writer):
        await read_request(reader)
        await at_eof(reader)
        client_closed.set()

    async with Raw(silent) as server, pooled() as pool:
        with pytest.raises(UpstreamTimeout):
            await within(pool.post(server.url, "/v1/x", b"{}", idle_timeout=0.3))
        await within(client_closed.wait())
        assert pool.connections(server.url) == 0


async def test_stream_silent_after_a_chunk_is_a_timeout():
    client_closed = asyncio.Event()

    async def one_chunk(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await at_eof(reader)
        client_closed.set()

    async with Raw(one_chunk) as server, pooled() as pool:
        r = await within(pool.post(server.url, "/v1/x", b"{}", idle_timeout=0.3))
        chunks = r.chunks()
        try:
            assert await within(chunks.__anext__()) == b"hello"
            with pytest.raises(UpstreamTimeout):
                await within(chunks.__anext__())
        finally:
            await chunks.aclose()
            r.release()
        await within(client_closed.wait())


async def test_stream_longer_than_the_idle_timeout_is_fine_while_bytes_keep_coming():
    # 30 chunks 0.05 s apart: the stream lasts 1.5 s, three idle timeouts, and
    # a stall of up to 0.45 s in the test process still passes.
    n = 30

    async def steady(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    async with Engine(steady=steady) as engine, pooled() as pool:
        r = await within(pool.post(engine.url, "/steady", b"{}", idle_timeout=0.5))

        async def consume():
            return b"".join([chunk async for chunk in r.chunks()])
        try:
            got = await within(consume())
        finally:
            r.release()
        assert got == b"".join(b"data: %d\n\n" % i for i in range(n))
        assert pool.connections(engine.url) == 1        # and back in the pool


# -- 10. giving up on an answer -----------------------------------------------------------------


async def test_release_before_the_end_closes_the_connection_and_the_engine_sees_it():
    engine_saw_it = asyncio.Event()

    async def endless(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: token\n\n")
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            engine_saw_it.set()     # how an engine frees the request's slot
            raise

    async with Engine(endless=endless) as engine, pooled() as pool:
        r = await within(pool.post(engine.url, "/endless", b"{}"))
        chunks = r.chunks()
        assert await within(chunks.__anext__())
        r.release()
        await chunks.aclose()
        assert pool.connections(engine.url) == 0
        await within(engine_saw_it.wait())


async def test_cancelling_a_post_before_the_headers_closes_the_connection():
    request_in = asyncio.Event()
    client_closed = asyncio.Event()

    async def thinking(reader, writer):
        await read_request(reader)
        request_in.set()
        await at_eof(reader)
        client_closed.set()

    async with Raw(thinking) as server, pooled() as pool:
        task = asyncio.create_task(pool.post(server.url, "/v1/x", b"{}"))
        await within(request_in.wait())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(task)
        await within(client_closed.wait())
        assert pool.connections(server.url) == 0


# -- 11. back-pressure --------------------------------------------------------------------------

# Far past what the client buffers before it stops reading (256 KiB) plus what
# the sockets hold: the engine stalled after about 4 MiB here, its send buffer
# grown to tcp_wmem's 4 MiB.
BIG = 16 * 1024 * 1024


# With an idle timeout shorter than the reader's pause: the engine is not
# silent, the reader is slow, and the answer must not end as a timeout.
@pytest.mark.parametrize("idle_timeout", [None, 0.3])
async def test_a_reader_that_does_not_read_stops_the_engine_and_then_gets_every_byte(idle_timeout):
    all_written = asyncio.Event()
    body = bytes(range(256)) * (BIG // 256)

    async def firehose(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        view = memoryview(body)
        for at in range(0, len(body), 65536):
            writer.write(view[at:at + 65536])
            await writer.drain()
        all_written.set()
        await read_request(reader)

    async with Raw(firehose) as server, pooled() as pool:
        r = await within(pool.post(server.url, "/v1/x", b"{}", idle_timeout=idle_timeout))
        try:
            # Nobody reads: the engine's writes must stall. (Were the pool to
            # keep reading, the whole body would sit in its memory within this
            # second; a slow machine could at worst let that pass, never fail
            # a pool that pauses.)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(all_written.wait()), 1.0)
            got = await within(r.read(), 30)
        finally:
            r.release()
        assert len(got) == len(body)
        assert got == body
        assert all_written.is_set()
        assert pool.connections(server.url) == 1


# -- 12. limits --------------------------------------------------------------------------------


def held_engine():
    """An engine whose answers wait for the test: `gates` gets one Event per request, in arrival order."""
    gates: list[asyncio.Event] = []

    async def held(request):
        gate = asyncio.Event()
        gates.append(gate)
        await gate.wait()
        return web.Response(body=b"done")

    return Engine(held=held, quick=quick), gates


async def quick(request):
    return web.Response(body=b"quick")


async def finish(task: asyncio.Task) -> bytes:
    r = await within(task)
    try:
        return await within(r.read())
    finally:
        r.release()


async def test_limit_per_endpoint_holds_the_third_request_until_a_connection_comes_free():
    engine, gates = held_engine()
    async with engine, pooled(limit_per_endpoint=2) as pool:
        tasks = [asyncio.create_task(pool.post(engine.url, "/held", b"{}")) for _ in range(3)]
        try:
            await until(lambda: len(gates) == 2, "two requests at the engine")
            await asyncio.sleep(0.2)        # room for a third connection, were the limit not kept
            assert len(gates) == 2
            assert engine.accepted == 2
            assert pool.connections(engine.url) == 2
            gates[0].set()
            done, pending = await within(asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED))
            assert len(done) == 1
            assert await finish(done.pop()) == b"done"
            await until(lambda: len(gates) == 3, "the third request to reach the engine")
            assert engine.accepted == 2     # on the connection that came free
            for gate in gates:
                gate.set()
            for task in pending:
                assert await finish(task) == b"done"
        finally:
            for gate in gates:
                gate.set()
            for task in tasks:
                task.cancel()
        assert pool.connections(engine.url) == 2
        assert pool._waiters == {}      # the queue of the wait is gone with it


async def test_limit_total_closes_an_idle_connection_to_another_engine():
    async with Engine(quick=quick) as a, Engine(quick=quick) as b, \
            pooled(limit_total=2) as pool:
        for r in await within(asyncio.gather(*(pool.post(a.url, "/quick", b"{}") for _ in range(2)))):
            assert await within(r.read()) == b"quick"
            r.release()
        assert pool.connections(a.url) == 2             # both idle, the total taken
        assert await fetch(pool, b.url, "/quick") == (200, b"quick")     # not waiting forever
        assert pool.connections(a.url) == 1
        assert pool.connections(b.url) == 1
        await until(lambda: sum(t.is_closing() for t in a.transports) == 1, "engine A to see one connection closed")


async def test_limit_total_waits_for_a_busy_connection_to_another_engine():
    a, gates = held_engine()
    async with a, Engine(quick=quick) as b, pooled(limit_total=2) as pool:
        held = [asyncio.create_task(pool.post(a.url, "/held", b"{}")) for _ in range(2)]
        try:
            await until(lambda: len(gates) == 2, "two requests at engine A")
            to_b = asyncio.create_task(fetch(pool, b.url, "/quick"))
            await asyncio.sleep(0.2)        # room to connect, were the limit not kept
            assert not to_b.done()
            assert b.accepted == 0
            gates[0].set()
            done, pending = await within(asyncio.wait(held, return_when=asyncio.FIRST_COMPLETED))
            assert not to_b.done()          # the answer is in, but its connection is not free yet
            assert await finish(done.pop()) == b"done"      # released: idle, and B takes its place
            assert await within(to_b) == (200, b"quick")
            assert pool.connections(a.url) == 1
            gates[1].set()
            assert await finish(pending.pop()) == b"done"
        finally:
            for gate in gates:
                gate.set()
            for task in held:
                task.cancel()
        assert pool.connections(a.url) + pool.connections(b.url) <= 2


# -- 13. keep-alive expiry --------------------------------------------------------------------


async def test_an_idle_connection_past_keepalive_timeout_is_not_reused():
    clock = FakeClock()

    async def answer(request):
        return web.Response(body=b"ok")

    # A long keep-alive in real time, so the pool's sweep (a real timer) cannot
    # be what closes the connection: only the fake clock moves past it.
    async with Engine(answer=answer) as engine, pooled(keepalive_timeout=10.0, clock=clock) as pool:
        assert await fetch(pool, engine.url, "/answer") == (200, b"ok")
        clock.now += 9.0
        assert await fetch(pool, engine.url, "/answer") == (200, b"ok")
        assert engine.accepted == 1                     # still young: reused
        clock.now += 10.5
        assert await fetch(pool, engine.url, "/answer") == (200, b"ok")
        assert engine.accepted == 2                     # expired: a new connection
        assert pool.connections(engine.url) == 1        # and the old one closed
        await until(lambda: engine.transports[0].is_closing(), "the engine to see the expired connection closed")


async def test_the_sweep_closes_expired_idle_connections():
    async def answer(request):
        return web.Response(body=b"ok")

    async with Engine(answer=answer) as engine, pooled(keepalive_timeout=0.2) as pool:
        assert await fetch(pool, engine.url, "/answer") == (200, b"ok")
        assert pool.connections(engine.url) == 1
        await until(lambda: pool.connections(engine.url) == 0, "the sweep to close the idle connection")
        await until(lambda: engine.transports[0].is_closing(), "the engine to see it closed")


# -- 14. the request on the wire ---------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["/prefix", "/prefix/"])
async def test_request_carries_the_url_path_prefix_host_and_json_headers(prefix):
    seen = []

    async def record(reader, writer):
        while (request := await read_request(reader)) is not None:
            seen.append(request)
            writer.write(reply(b"{}"))

    body = '{"prompt": "héllo"}'.encode()
    async with Raw(record) as server, pooled() as pool:
        assert await fetch(pool, server.url + prefix, "/v1/x", body) == (200, b"{}")
    (head, sent), = seen
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "POST /prefix/v1/x HTTP/1.1"
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:] if line)}
    assert headers["host"] == "127.0.0.1:%d" % server.port
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(body))
    assert sent == body


@pytest.mark.parametrize("size", [JOIN_BELOW - 1, JOIN_BELOW, 4 << 20], ids=["joined", "beside", "4MiB"])
async def test_a_body_on_either_side_of_the_join_bound_arrives_whole_and_the_connection_carries_the_next(size):
    seen = []

    async def record(reader, writer):
        while (request := await read_request(reader)) is not None:
            seen.append(request[1])
            writer.write(reply(b"{}"))

    body = b'{"input": "%s"}' % (b"x" * (size - 13))
    assert len(body) == size
    async with Raw(record) as server, pooled() as pool:
        assert await fetch(pool, server.url, "/v1/x", body) == (200, b"{}")
        assert await fetch(pool, server.url, "/v1/x", b"{}") == (200, b"{}")
        assert server.accepted == 1
    assert seen == [body, b"{}"]


class Recording:
    """A transport that keeps what it is handed, to see whether the body was copied on the way."""

    def __init__(self):
        self.calls: list[tuple[str, list[bytes]]] = []

    def write(self, data):
        self.calls.append(("write", [data]))

    def writelines(self, data):
        self.calls.append(("writelines", list(data)))


def test_a_long_body_is_handed_to_the_transport_beside_its_head_not_copied_into_it():
    long, short = b"x" * JOIN_BELOW, b"{}"
    transport = Recording()
    write_request(transport, b"HEAD", long)
    write_request(transport, b"HEAD", short)
    (long_call, (first, second)), (short_call, (joined,)) = transport.calls
    assert long_call == "writelines" and first == b"HEAD" and second is long
    assert short_call == "write" and joined == b"HEAD{}"


# -- 15. interim answers -------------------------------------------------------------------------


@pytest.mark.parametrize("apart", [False, True], ids=["one-write", "two-writes"])
async def test_100_continue_before_the_answer_is_skipped(apart):
    async def continues(reader, writer):
        while await read_request(reader):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if apart:
                await writer.drain()
                await asyncio.sleep(0.02)
            writer.write(reply(b"real answer", extra=b"X-Final: yes\r\n"))

    async with Raw(continues) as server, pooled() as pool:
        for _ in range(2):
            r = await within(pool.post(server.url, "/v1/x", b"{}"))
            try:
                assert r.status == 200
                assert r.headers["x-final"] == "yes"
                assert await within(r.read()) == b"real answer"
            finally:
                r.release()
        assert server.accepted == 1


async def test_engines_that_come_and_go_leave_nothing_behind_in_the_pool():
    # Every replica is a new URL; a router running for months sees thousands.
    async def keeps_answering(reader, writer):
        while await read_request(reader):
            writer.write(reply(b"ok"))

    async with pooled(keepalive_timeout=0.2) as pool:
        urls = []
        for _ in range(5):
            async with Raw(keeps_answering) as server:
                assert await fetch(pool, server.url) == (200, b"ok")
                urls.append(server.url)
        await until(lambda: all(pool.connections(u) == 0 for u in urls), "the sweep to close every connection")
        await until(lambda: not pool._idle and not pool._waiters and pool._total == 0,
                    "the pool's tables to be empty")


async def test_an_engine_behind_tls_with_a_private_ca_trusted_through_ssl_cert_file(tmp_path, monkeypatch):
    # Fleets that put engines behind TLS use their own CA; the pool verifies
    # against the system's trust store, which SSL_CERT_FILE points elsewhere.
    ca = trustme.CA()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(tls)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))

    async def hello(request):
        return web.Response(body=await request.read() + b" over tls")

    async with Engine(tls=tls, v1=hello) as engine:
        async with pooled() as pool:
            # Not trusted: refused before any request is sent, so safe to retry elsewhere.
            with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await within(pool.post(engine.url, "/v1", b"{}"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
        async with pooled() as pool:
            assert await fetch(pool, engine.url, "/v1", b"{}") == (200, b"{} over tls")
            assert await fetch(pool, engine.url, "/v1", b"[]") == (200, b"[] over tls")
            assert engine.accepted == 2     # the failed handshake, then one kept-alive connection
