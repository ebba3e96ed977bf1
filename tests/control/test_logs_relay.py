"""The log relay's rules without a network: who may answer a request, and every bound it keeps."""
from __future__ import annotations

import asyncio

import pytest

from llmgwctl.control import logs
from llmgwctl.control.auth import ControlAuth
from llmgwctl.control.logs import LogRelay, LogRelayError


def test_a_request_is_handed_to_its_node_once_and_only_that_node_may_answer_it():
    async def main():
        relay = LogRelay()
        stream = relay.open("n1", "r1", tail=50, follow=False)
        assert relay.asked("n1").is_set() and not relay.asked("n2").is_set()
        assert relay.take("n2") == []
        assert relay.take("n1") == [{"id": stream.id, "replica": "r1", "tail": 50, "follow": False}]
        assert relay.take("n1") == [] and not relay.asked("n1").is_set()
        # Another node's agent (its token passed the auth middleware for n2) cannot feed n1's stream.
        assert await relay.deliver("n2", stream.id, ["forged"]) is False
        assert stream.chunks.empty()
        assert await relay.deliver("n1", stream.id, ["real"], done=True) is True
        assert stream.chunks.get_nowait() == {"lines": ["real"], "done": True}
        # Done: nothing more is taken; a closed stream is gone (the agent's POST gets 410).
        assert await relay.deliver("n1", stream.id, ["late"]) is False
        relay.close(stream.id)
        assert relay.open_streams() == 0
    asyncio.run(main())


def test_streams_lines_and_line_lengths_are_bounded():
    async def main():
        relay = LogRelay()
        streams = [relay.open("n1", f"r{i}", 10, True) for i in range(logs.MAX_STREAMS_PER_NODE)]
        with pytest.raises(LogRelayError, match="node n1"):
            relay.open("n1", "one-more", 10, True)
        assert relay.open("n2", "r", 10**9, True).tail == logs.MAX_TAIL
        many = ["x" * (logs.MAX_LINE + 10)] * (logs.MAX_CHUNK_LINES + 5)
        assert await relay.deliver("n1", streams[0].id, many)
        chunk = streams[0].chunks.get_nowait()
        assert len(chunk["lines"]) == logs.MAX_CHUNK_LINES and len(chunk["lines"][0]) == logs.MAX_LINE
        # A closed stream's pending request is not handed out any more.
        relay.close(streams[1].id)
        assert streams[1].id not in [r["id"] for r in relay.take("n1")]
    asyncio.run(main())


def test_a_reader_that_stops_reading_has_its_stream_cut(monkeypatch):
    monkeypatch.setattr(logs, "DELIVER_TIMEOUT", 0.01)

    async def main():
        relay = LogRelay()
        stream = relay.open("n1", "r1", 0, True)
        for _ in range(logs.QUEUE_CHUNKS):
            assert await relay.deliver("n1", stream.id, ["line"])
        assert await relay.deliver("n1", stream.id, ["one too many"]) is False
        assert relay.open_streams() == 0
    asyncio.run(main())


def test_the_console_files_are_open_and_nothing_else_is():
    auth = ControlAuth("admin-" + "a" * 20)
    for path in ("/", "/ui", "/ui/", "/ui/app.js", "/ui/style.css", "/ui/index.html", "/healthz"):
        assert auth.check(path, None) is None, path
    for path in ("/api/v1/watch/status", "/api/v1/status", "/ui/../api/v1/status", "/ui/x/app.js",
                 "/uiapp.js", "/api/v1/replicas/r/logs", "//"):
        refusal = auth.check(path, None)
        assert refusal is not None and refusal.status == 401, path


def test_the_status_stream_takes_the_admin_token_as_status_does_not_a_routers():
    admin, agent = "admin-" + "a" * 20, "agent-" + "b" * 20
    auth = ControlAuth(admin, agent)
    assert auth.check("/api/v1/watch/status", f"Bearer {admin}") is None
    assert auth.check("/api/v1/watch/status", f"Bearer {agent}").status == 401
    assert auth.check("/api/v1/watch/endpoints", f"Bearer {agent}") is None
