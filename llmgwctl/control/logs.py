"""Engine logs relayed from a node's agent to `llmgwctl logs`: the controller asks, the agent answers.

Agents only dial out, so the controller cannot fetch a log from a node. It asks
over the connection every agent already keeps open -- the long-poll of its
desired replicas -- and the agent answers with POSTs of its own:

    llmgwctl logs R [-f] ── GET /api/v1/replicas/R/logs?tail=N&follow=1 ──► controller: LogRelay.open()
                                                                               │ wakes R's node's long-poll
    agent ◄── desired answer {"version", "replicas", "log_requests": [{"id", "replica", "tail", "follow"}]}
    agent ── POST /api/v1/agents/{node}/logs/{id} {"lines": [...], "done", "error"} ──► relay ──► the GET
          ◄── 200 while someone reads; 410 once the reader left (a following agent stops there)

The GET answers NDJSON, one object a line: `{"lines": [...]}` as they come,
`{}` to keep an idle follow alive, and last `{"done": true}` or
`{"error": "..."}`, so the CLI tells an ended log from a failure.

Who may send what: a POST is authenticated as the node in its path (node
tokens, `auth`), and a request is taken only from the node it was sent to, so
an agent can answer for its own node's replicas and nobody else's. Everything
is bounded: streams at once, lines per request and per chunk, the length of a
line, how long the first answer and a follow's silence may take, and how far a
reader may fall behind before its stream is cut.

It must not know how agents read files, nor how the CLI prints.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .errors import ControlError

# Streams open at once over the whole fleet, and per node: each holds a queue
# and, when following, an agent task; an operator runs a handful.
MAX_STREAMS, MAX_STREAMS_PER_NODE = 64, 8
# `--tail` is capped here: 10 000 lines is more than a terminal's scrollback
# and bounds what one request makes an agent read and send.
MAX_TAIL = 10_000
# Lines per POST and characters per line, taken from agents: one chunk stays
# under ~2 MB, well inside the control API's body limit.
MAX_CHUNK_LINES, MAX_LINE = 500, 4096
# Chunks queued for a slow reader. Past them the agent's POST waits up to
# DELIVER_TIMEOUT for room, then the stream is cut: a reader that stopped
# reading must not make the controller buffer a chatty engine's whole log.
QUEUE_CHUNKS, DELIVER_TIMEOUT = 16, 10.0
# The agent hears a request at once (its long-poll is held open, and answered
# when a request comes); 10 s covers an agent in the middle of a reconnect.
FIRST_ANSWER = 10.0
# A following agent sends an empty chunk every FOLLOW_HEARTBEAT seconds
# (agent.logs) to learn whether the reader is still there; three missed ones
# mean the agent or its node is gone, and the reader is told so.
FOLLOW_HEARTBEAT = 10.0
FOLLOW_SILENCE = 3 * FOLLOW_HEARTBEAT


class LogRelayError(ControlError):
    """A log stream cannot be opened (too many at once); the message says which limit."""


class LogRequest(TypedDict):
    """One entry of a desired answer's `log_requests`: what an agent reads to start a stream."""

    id: str
    replica: str
    tail: int
    follow: bool

@dataclass(eq=False)
class LogStream:
    """One reader's request, from `open` until its reader or its agent ends it."""

    id: str
    node: str
    replica: str
    tail: int
    follow: bool
    # What the agent sent, as the reader gets it: {"lines": [...]}, with "done"; or {"error": "..."}.
    chunks: asyncio.Queue[dict[str, Any]] = field(default_factory=lambda: asyncio.Queue(QUEUE_CHUNKS))
    closed: bool = False

    def request(self) -> LogRequest:
        """What the agent is told (in its desired answer's `log_requests`)."""
        return {"id": self.id, "replica": self.replica, "tail": self.tail, "follow": self.follow}


class LogRelay:
    def __init__(self) -> None:
        self._streams: dict[str, LogStream] = {}
        self._pending: dict[str, list[str]] = {}     # node -> ids its agent has not been told yet
        self._asked: dict[str, asyncio.Event] = {}   # node -> set while it has pending requests

    def open(self, node: str, replica: str, tail: int, follow: bool) -> LogStream:
        if len(self._streams) >= MAX_STREAMS:
            raise LogRelayError(f"{MAX_STREAMS} log streams are open already; close one and try again")
        if sum(s.node == node for s in self._streams.values()) >= MAX_STREAMS_PER_NODE:
            raise LogRelayError(f"{MAX_STREAMS_PER_NODE} log streams of node {node} are open already")
        stream = LogStream(id=secrets.token_hex(12), node=node, replica=replica,
                           tail=max(0, min(MAX_TAIL, tail)), follow=follow)
        self._streams[stream.id] = stream
        self._pending.setdefault(node, []).append(stream.id)
        self.asked(node).set()
        return stream

    def asked(self, node: str) -> asyncio.Event:
        """Set while `node` has requests its agent has not been handed: the desired long-poll answers then."""
        return self._asked.setdefault(node, asyncio.Event())

    def take(self, node: str) -> list[LogRequest]:

        """The node's pending requests, handed out once (in its agent's desired answer)."""
        self.asked(node).clear()
        ids = self._pending.pop(node, [])
        return [self._streams[i].request() for i in ids if i in self._streams]

    async def deliver(self, node: str, stream_id: str, lines: list[str], done: bool = False,
                      error: str | None = None) -> bool:
        """Queue what an agent sent; False when nobody reads it any more (or it was never `node`'s)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.node != node or stream.closed:
            return False
        chunk: dict[str, Any] = {"lines": [line[:MAX_LINE] for line in lines[:MAX_CHUNK_LINES]]}
        if error:
            chunk = {"error": str(error)[:MAX_LINE]}
        elif done:
            chunk["done"] = True
        try:
            await asyncio.wait_for(stream.chunks.put(chunk), DELIVER_TIMEOUT)
        except asyncio.TimeoutError:
            self.close(stream_id)
            return False
        if done or error:
            stream.closed = True
        return True

    def close(self, stream_id: str) -> None:
        """The reader is gone: forget the stream; the agent's next POST for it gets 410 and stops."""
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        stream.closed = True
        pending = self._pending.get(stream.node)
        if pending and stream_id in pending:
            pending.remove(stream_id)
            if not pending:
                self._pending.pop(stream.node, None)
                self.asked(stream.node).clear()

    def open_streams(self) -> int:
        return len(self._streams)
