"""Responses affinity: which replica stored a response, so the requests that name it go there.

OpenAI's Responses API keeps state on the server: a response is stored
where it was made (vLLM keeps it in the API server's memory, with
VLLM_ENABLE_RESPONSES_API_STORE=1), and a later request names it --
`previous_response_id` to continue the conversation, `GET`, `DELETE`,
`/cancel` and `/input_items` on `/v1/responses/{id}`. Only the replica
that stored it can answer; any other answers 404, so with two replicas
about half of the turns of a conversation would fail.

`ResponseStore` remembers, for each response id an engine's answer carried,
the replica that made it, its model and the API key it was made with
(`Binding`): an LRU of at most `max_entries`, each kept `ttl` seconds from
when it was made. Both bounds are RouterConfig's (`responses_kept`,
`responses_ttl`, where each default's reason is). The id is read off the
answer as it passes: the first member of a whole answer (`id_of_whole`),
the `response.created` event, the first, of a stream (`FirstEvent`).

A binding is the key's: another key (or, on an open router, a request with
a key after keys were turned on) is told the id does not exist, the same
404 as for an id never seen, so no key learns of another's responses. When
the replica that stored a response is no longer routed to (stopped,
drained, restarted at another URL), its requests get a 404 that says so,
not another replica's confused one; the engine's store went with it.

Kept in this router's memory only: a router restarted, or another router
behind the same load balancer, does not know the id (a 404 naming why).

It must not know HTTP beyond the error responses, nor the balancer.
"""
from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from . import errors

__all__ = ["Binding", "FirstEvent", "ResponseStore", "id_of_whole", "valid_id"]

# What a response id may look like to be one the router could have stored:
# vLLM's and OpenAI's are `resp_` and 32-64 characters of hex or base62;
# anything past 128 characters or outside these is no engine's id, and is
# answered as an unknown one without a lookup.
MAX_ID_CHARS = 128
_ID = re.compile(rf"[A-Za-z0-9_\-]{{1,{MAX_ID_CHARS}}}")
# A whole answer's top-level id, when it is the first member (vLLM's and
# OpenAI's order), read without parsing the rest.
_WHOLE_ID = re.compile(rb'\s*\{\s*"id"\s*:\s*"([A-Za-z0-9_\-]{1,128})"')
# A stream's response.created event with the response first (vLLM's order).
_CREATED_ID = re.compile(rb'\s*\{\s*"response"\s*:\s*\{\s*"id"\s*:\s*"([A-Za-z0-9_\-]{1,128})"')
# Past this, an answer or a first event whose id is not its first member is
# not parsed for it (a response echoes its instructions and tools, rarely
# past some KB): parsing megabytes on the loop for one id would stall every
# other request. Such a response is not remembered; the next turn naming it
# gets the router's 404 saying so.
MAX_PARSED = 1 << 20


def valid_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class Binding:
    """Where a response was stored: its replica (id and URL then), its model (canonical), and who made it."""

    replica: str
    url: str
    model: str
    key: str | None         # the API key's name; None: made on an open router
    expires: float


class ResponseStore:
    """Response id -> `Binding`, at most `max_entries`, each for `ttl` seconds; the least recently used goes first."""

    __slots__ = ("max_entries", "ttl", "_clock", "_kept")

    def __init__(self, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._kept: OrderedDict[str, Binding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def remember(self, response_id: str, replica: str, url: str, model: str, key: str | None) -> None:
        if self.max_entries <= 0:
            return
        kept = self._kept
        kept[response_id] = Binding(replica, url, model, key, self._clock() + self.ttl)
        kept.move_to_end(response_id)
        while len(kept) > self.max_entries:
            kept.popitem(last=False)

    def lookup(self, response_id: str, key: str | None) -> Binding | None:
        """The binding of `response_id` made with `key`; None when unknown, expired, or another key's."""
        kept = self._kept
        found = kept.get(response_id)
        if found is None:
            return None
        if found.expires <= self._clock():
            del kept[response_id]
            return None
        if found.key != key:
            return None
        kept.move_to_end(response_id)
        return found

    def forget(self, response_id: str) -> None:
        self._kept.pop(response_id, None)


def id_of_whole(data: bytes) -> str | None:
    """The top-level `id` of a whole JSON answer; None when it has none (or it is too large to look for one)."""
    m = _WHOLE_ID.match(data)
    if m is not None:
        return m.group(1).decode()
    if len(data) > MAX_PARSED:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    found = doc.get("id") if isinstance(doc, dict) else None
    return found if isinstance(found, str) and valid_id(found) else None


class FirstEvent:
    """A Responses stream's first event with data (`response.created`), read off its bytes as they pass: its id.

    `feed` returns False once there is nothing more to read (the id found,
    or that event had none, or it ran past `MAX_PARSED`), so the answer
    path stops feeding it; comments before it are skipped.
    """

    __slots__ = ("response_id", "_seen")

    def __init__(self) -> None:
        self.response_id: str | None = None
        self._seen = b""

    def feed(self, chunk: bytes) -> bool:
        seen = self._seen + chunk if self._seen else chunk
        while True:
            lf, crlf = seen.find(b"\n\n"), seen.find(b"\r\n\r\n")
            end, size = (lf, 2) if crlf < 0 or 0 <= lf < crlf else (crlf, 4)
            if end < 0:
                if len(seen) > MAX_PARSED:
                    self._seen = b""
                    return False
                self._seen = seen
                return True
            event, seen = seen[:end], seen[end + size:]
            data = [line for line in event.splitlines() if line.startswith(b"data:")]
            if data:
                self._seen = b""
                self.response_id = _created_id(data[0][5:])
                return False
            # A comment (": ping") or a bare `event:` line before the first data: read on.


def _created_id(payload: bytes) -> str | None:
    m = _CREATED_ID.match(payload)
    if m is not None:
        return m.group(1).decode()
    try:
        doc = json.loads(payload)
    except ValueError:
        return None
    response = doc.get("response") if isinstance(doc, dict) else None
    found = response.get("id") if isinstance(response, dict) else None
    return found if isinstance(found, str) and valid_id(found) else None


# -- the router's answers ----------------------------------------------------------------

def not_found(response_id: str) -> web.Response:
    """The same 404 for an id never seen, expired, forgotten, or another key's: no key learns of another's."""
    return errors.response(
        404, f"no response {errors.quote(response_id, 80)} is known to this router: it was never made through it, "
        "was deleted, was made with another API key, or is older than the router keeps responses for "
        "(or the router restarted since)", "invalid_request_error", "response_not_found")


def replica_gone(response_id: str, binding: Binding) -> web.Response:
    return errors.response(
        404, f"response {response_id!r} was stored by replica {binding.replica} of model {binding.model!r}, which "
        "is no longer serving (stopped, drained or restarted), and its stored responses went with it; start the "
        "conversation again without previous_response_id", "invalid_request_error", "response_replica_gone")


def replica_unreachable(response_id: str, binding: Binding, detail: str) -> web.Response:
    return errors.response(
        502, f"response {response_id!r} is stored by replica {binding.replica} of model {binding.model!r}, which "
        f"did not take the request ({detail}); no other replica holds it", "upstream_error",
        "response_replica_unreachable")


def other_model(response_id: str, binding: Binding, asked: str) -> web.Response:
    return errors.response(
        400, f"response {response_id!r} was made by model {binding.model!r} and is stored by its replica; it "
        f"cannot be continued by model {asked!r}: name {binding.model!r} to continue it", "invalid_request_error",
        "response_model_mismatch")
