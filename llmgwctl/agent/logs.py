"""Answering the controller's log requests: send one replica's engine log, and follow it when asked.

The controller asks in the answer to the desired long-poll (`log_requests`,
see llmgwctl.control.logs, where the whole exchange is drawn); this module
answers with POSTs to `/api/v1/agents/{node}/logs/{id}`: the last `tail`
lines, then, when following, new lines as the engine writes them and an empty
chunk every FOLLOW_HEARTBEAT seconds of silence. It stops at the controller's
410 (nobody reads any more), at a failed POST, or when the agent stops.

Only replicas this agent runs are answered for: a request naming another
gets an error, and no path outside the agent's log directory is ever read
(the file name comes from `log_path`, which keeps only safe characters).
It must not know how the controller relays what it sends.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..aio import cancel_and_wait, follow_file, sleep_unless

log = logging.getLogger("llmgw.agent.logs")

# Streams this agent serves at once: the controller allows 8 per node; one more
# request than that is answered with an error rather than left hanging.
MAX_STREAMS = 8
# The controller's own bounds (control.logs), kept here so an agent never
# sends what it would cut: lines per POST, characters per line, lines of tail.
CHUNK_LINES, MAX_LINE, MAX_TAIL = 500, 4096, 10_000
# Read at most this much of the log's end for a tail: 10 000 lines of 200
# characters; a log of longer lines yields fewer of them, never a huge read.
TAIL_BYTES = 2 * 1024 * 1024
# New bytes read per wake while following: a chatty engine is sent in pieces.
FOLLOW_READ = 256 * 1024
# An empty chunk after this long without new lines, to learn whether the
# reader is still there (the controller gives up after three missed ones).
FOLLOW_HEARTBEAT = 10.0


class LogPoster(Protocol):
    """Where chunks go: the agent's controller client. True while someone reads."""

    async def post_logs(self, request_id: str, body: dict[str, Any]) -> bool: ...


def read_tail(path: Path, lines: int) -> tuple[list[str], int]:
    """The last `lines` lines of `path` and the offset its end had (where following starts). Blocking."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - TAIL_BYTES)
            f.seek(start)
            data = f.read(size - start)
    except FileNotFoundError:
        return [], 0
    text = data.decode("utf-8", errors="replace").splitlines()
    if start > 0 and text:
        text = text[1:]     # cut by the seek
    return (text[-lines:] if lines else []), size


def read_from(path: Path, offset: int) -> tuple[bytes, int]:
    """Bytes written after `offset` (from 0 again when the log was truncated by rotation), and the new offset."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < offset:
                offset = 0
            f.seek(offset)
            data = f.read(FOLLOW_READ)
    except FileNotFoundError:
        return b"", offset
    return data, offset + len(data)


class LogSender:
    def __init__(self, poster: LogPoster, log_path: Callable[[str], Path], owns: Callable[[str], bool],
                 stop: asyncio.Event):
        self.poster = poster
        self.log_path = log_path
        self.owns = owns
        self.stop = stop
        self.tasks: set[asyncio.Task[None]] = set()

    def handle(self, requests: Any) -> None:
        """Start answering each request of a desired answer's `log_requests` (malformed ones are skipped)."""
        if not isinstance(requests, list):
            return
        for req in requests:
            if not isinstance(req, dict) or not isinstance(req.get("id"), str) or not isinstance(req.get("replica"), str):
                log.warning("log request %r is malformed; skipped", str(req)[:200])
                continue
            task = asyncio.create_task(self._answer(req), name=f"logs-{req['id'][:8]}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        await cancel_and_wait(*self.tasks)

    async def _answer(self, req: dict[str, Any]) -> None:

        rid, replica = req["id"], req["replica"]
        try:
            if len(self.tasks) > MAX_STREAMS:
                await self.poster.post_logs(rid, {"error": f"this agent serves {MAX_STREAMS} log streams at once"})
                return
            if not self.owns(replica):
                await self.poster.post_logs(rid, {"error": f"this node runs no replica {replica!r}"})
                return
            tail = max(0, min(MAX_TAIL, int(req.get("tail") or 0)))
            path = self.log_path(replica)
            lines, offset = await asyncio.to_thread(read_tail, path, tail)
            follow = bool(req.get("follow"))
            if not await self._send(rid, lines, done=not follow):
                return
            if follow:
                await self._follow(rid, path, offset)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must end one stream, not the agent
            log.exception("log request %s for %s failed", rid, replica)

    async def _send(self, rid: str, lines: list[str], done: bool = False) -> bool:
        lines = [line[:MAX_LINE] for line in lines]
        for i in range(0, max(1, len(lines)), CHUNK_LINES):
            last = i + CHUNK_LINES >= len(lines)
            if not await self.poster.post_logs(rid, {"lines": lines[i:i + CHUNK_LINES], "done": done and last}):
                return False
        return True

    async def _follow(self, rid: str, path: Path, offset: int) -> None:
        ended = asyncio.Event()         # the reader left: ends the file watch below
        partial = b""
        loop = asyncio.get_running_loop()
        last_sent = loop.time()

        async def drain() -> bool:
            nonlocal offset, partial, last_sent
            while True:
                data, offset = await asyncio.to_thread(read_from, path, offset)
                if not data:
                    return True
                *complete, partial = (partial + data).split(b"\n")
                if complete:
                    lines = [c.decode("utf-8", errors="replace").rstrip("\r") for c in complete]
                    if not await self._send(rid, lines):
                        return False
                    last_sent = loop.time()

        async def watch() -> None:
            nonlocal last_sent
            try:
                async for _ in follow_file(path, ended, recheck=1.0):
                    if not await drain():
                        ended.set()
                        return
                    if loop.time() - last_sent >= FOLLOW_HEARTBEAT:
                        if not await self.poster.post_logs(rid, {"lines": []}):
                            ended.set()
                            return
                        last_sent = loop.time()
            except FileNotFoundError:
                await self.poster.post_logs(rid, {"error": f"the log directory {path.parent} is gone"})
            ended.set()

        if not await drain():
            return
        watcher = asyncio.create_task(watch())
        try:
            await sleep_unless(None, ended, self.stop)
        finally:
            ended.set()
            await cancel_and_wait(watcher)
