"""The store of response bindings and the reading of ids off answers (router/responses.py), without a socket."""
from __future__ import annotations

import json

import pytest

from llmgwctl.router import responses
from llmgwctl.router.responses import FirstEvent, ResponseStore, id_of_whole

from ..support import FakeClock


def test_a_binding_is_found_by_the_key_that_made_it_only():
    store = ResponseStore(10, 60.0, FakeClock())
    store.remember("resp_a", "r1", "http://e1", "m", "alice")
    store.remember("resp_open", "r2", "http://e2", "m", None)
    found = store.lookup("resp_a", "alice")
    assert found is not None and (found.replica, found.url, found.model, found.key) == ("r1", "http://e1", "m", "alice")
    assert store.lookup("resp_a", "bob") is None
    assert store.lookup("resp_a", None) is None
    # Made on an open router: no key may claim it once keys are on.
    assert store.lookup("resp_open", "alice") is None and store.lookup("resp_open", None) is not None
    assert store.lookup("resp_never", "alice") is None


def test_a_binding_expires_after_its_ttl_from_when_it_was_made():
    clock = FakeClock()
    store = ResponseStore(10, 60.0, clock)
    store.remember("resp_a", "r1", "u", "m", None)
    clock.advance(59.0)
    assert store.lookup("resp_a", None) is not None
    clock.advance(1.0)
    assert store.lookup("resp_a", None) is None
    assert len(store) == 0


def test_past_its_bound_the_least_recently_used_goes_first():
    store = ResponseStore(3, 60.0, FakeClock())
    for i in range(3):
        store.remember(f"resp_{i}", "r", "u", "m", None)
    assert store.lookup("resp_0", None) is not None     # used: now the most recent
    store.remember("resp_3", "r", "u", "m", None)
    assert len(store) == 3
    assert store.lookup("resp_1", None) is None
    assert all(store.lookup(f"resp_{i}", None) is not None for i in (0, 2, 3))
    store.forget("resp_0")
    assert store.lookup("resp_0", None) is None


def test_a_store_of_size_zero_remembers_nothing():
    store = ResponseStore(0, 60.0, FakeClock())
    store.remember("resp_a", "r", "u", "m", None)
    assert len(store) == 0


@pytest.mark.parametrize("value, ok", [("resp_abc123", True), ("resp-" + "a" * 123, True), ("a" * 129, False),
                                       ("", False), ("resp_a/b", False), ("resp a", False), ("résp", False)])
def test_only_what_can_be_an_engines_id_is_looked_up(value, ok):
    assert responses.valid_id(value) is ok


def test_the_id_of_a_whole_answer_first_member_or_anywhere_at_the_top_level():
    assert id_of_whole(b'{"id":"resp_1","object":"response","output":[{"id":"msg_x"}]}') == "resp_1"
    assert id_of_whole(b' {\n "id" : "resp_2"}') == "resp_2"
    # Not first: parsed, and a nested id is not taken for it.
    assert id_of_whole(json.dumps({"output": [{"id": "msg_x"}], "id": "resp_3"}).encode()) == "resp_3"
    assert id_of_whole(json.dumps({"output": [{"id": "msg_x"}]}).encode()) is None
    assert id_of_whole(b"not json") is None
    assert id_of_whole(b'{"id": 5}') is None
    # Too large to parse for an id that is not first: not remembered, never a stall.
    assert id_of_whole(b'{"pad":"' + b"x" * (responses.MAX_PARSED + 1) + b'","id":"resp_4"}') is None


def _event(kind: str, payload: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()


def test_a_streams_id_is_read_off_its_first_event_however_its_bytes_arrive():
    created = _event("response.created", {"response": {"id": "resp_s", "object": "response"},
                                          "sequence_number": 0, "type": "response.created"})
    stream = created + _event("response.in_progress", {"response": {"id": "resp_other"}})
    for cut in (1, 7, len(created) - 1, len(created), len(stream)):
        watch = FirstEvent()
        if watch.feed(stream[:cut]):
            assert watch.response_id is None and cut < len(created)
            assert watch.feed(stream[cut:]) is False
        assert watch.response_id == "resp_s", cut
    # The type first, then the response: parsed.
    watch = FirstEvent()
    assert watch.feed(_event("response.created", {"type": "response.created", "response": {"id": "resp_t"}})) is False
    assert watch.response_id == "resp_t"
    # A first event without a response: nothing to remember, and nothing more is read.
    watch = FirstEvent()
    assert watch.feed(b'data: {"error": {"message": "x"}}\n\n') is False and watch.response_id is None
    # A comment before the first event (an engine's keep-alive): read past.
    watch = FirstEvent()
    assert watch.feed(b": ping\n\n") is True
    assert watch.feed(b'event: response.created\ndata: {"response":{"id":"resp_p"}}\n\n') is False
    assert watch.response_id == "resp_p"
    # CRLF framing.
    watch = FirstEvent()
    assert watch.feed(b'event: response.created\r\ndata: {"response":{"id":"resp_c"}}\r\n\r\n') is False
    assert watch.response_id == "resp_c"


def test_a_first_event_without_end_is_given_up_past_its_bound():
    watch = FirstEvent()
    assert watch.feed(b"data: " + b"x" * 1000) is True
    assert watch.feed(b"x" * responses.MAX_PARSED) is False
    assert watch.response_id is None


def test_a_responses_usage_is_read_as_a_chats_is():
    from llmgwctl.router.usage import StreamUsage, usage_tokens

    whole = json.dumps({"id": "resp_1", "output": [], "usage": {
        "input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 19}, "user": None}).encode()
    assert usage_tokens(whole) == (12, 7)
    stream = StreamUsage()
    stream.feed(_event("response.created", {"response": {"id": "resp_1", "usage": None}}))
    assert stream.usage is None
    completed = _event("response.completed", {"response": json.loads(whole), "type": "response.completed"})
    stream.feed(completed[:40])
    stream.feed(completed[40:])
    assert stream.usage == (12, 7)
