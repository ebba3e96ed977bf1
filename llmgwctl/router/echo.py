"""The name a client asked for, echoed in the answer: the engine's `"model":"SERVED"` rewritten to the alias.

A request by alias reaches the engine under the model's canonical name
(engines 404 a name they do not serve, see `jsonbody`), so the engine's
answer names the canonical model. Clients and their metering want the name
they sent back (a client asking for `default` should not learn, or have to
match on, which model that is today), so on the way back every
`"model":"SERVED"` member of the answer names the alias instead -- the
whole reply's and each stream chunk's or event's (chat, completions,
embeddings, Messages' `message_start`). Requests by the canonical name pay
nothing: no `Echo` is made for them.

Bytes, not documents: the answer is never parsed nor serialised again.

- A stream chunk is rewritten with one regular expression over its bytes.
  JSON escapes every quote inside a string, so `"model":"SERVED"` with bare
  quotes is always a member of an object, never text a model generated, and
  the objects of a stream chunk or event that have a `model` member are the
  chunk itself or the Messages event's `message` (a tool call's arguments
  travel as an escaped string in both APIs). A read of the socket that ends
  mid-event keeps back at most the bytes that could begin a match (from the
  first quote among its last `max_match - 1` bytes), sent with the next
  read; a read that ends a line keeps nothing back, so events leave as they
  arrive.
- A whole reply's `model` member is rewritten only at the top level: a
  Messages reply's `tool_use` block carries its input as an object, which a
  tool may well give a `model` member. The first match is taken when no
  object or array opens before it (the usual case: engines write `model`
  before `choices`, `data` and `content`); otherwise the top-level member
  is found by walking the top level (`jsonbody.model_span`).

It must not know about HTTP, endpoints or the catalog: the answer path
makes one per aliased request and feeds it bytes.
"""
from __future__ import annotations

import json
import re

from .jsonbody import model_span

__all__ = ["Echo"]

# Whitespace allowed on each side of the colon: compact JSON has none, a
# pretty-printer one; bounded so a held-back tail is bounded too.
_WS = rb"[ \t]{0,2}"


class Echo:
    """Rewrites the served model name to the asked one in one answer's bytes: whole (`whole`) or as a stream (`chunk`, `rest`)."""

    __slots__ = ("served", "asked", "_pattern", "_with", "_needle", "_hold", "_carry")

    def __init__(self, served: str, asked: str):
        self.served = served
        self.asked = asked
        # A '/' may come escaped ("\/"), as some JSON writers do.
        name = re.escape(json.dumps(served)[1:-1].encode()).replace(b"/", b"\\\\?/")
        self._pattern = re.compile(rb'"model"' + _WS + b":" + _WS + b'"' + name + b'"')
        self._with = b'"model":' + json.dumps(asked).encode()
        self._needle = b'"model"'
        # The longest match less one byte (`"model"`, the colon and its
        # whitespace, the quoted name with every '/' escaped): no more than
        # this can begin a match at a read's end.
        self._hold = len(b'"model"') + 5 + 2 + 2 * len(json.dumps(served)[1:-1]) - 1
        self._carry = b""

    def whole(self, data: bytes) -> bytes:
        """A whole reply with its top-level `model` naming the asked name, when it named the served one."""
        found = self._pattern.search(data)
        if found is None:
            return data
        head = data[:found.start()]
        if head.count(b"{") == 1 and b"[" not in head:
            return data[:found.start()] + self._with + data[found.end():]
        # Something opened before it: only the top-level member is the answer's.
        try:
            span = model_span(data)
        except ValueError:
            return data
        if span is None:
            return data
        start, end = span
        if self._pattern.fullmatch(b'"model":' + data[start:end]) is None:
            return data
        return data[:start] + self._with[len(b'"model":'):] + data[end:]

    def chunk(self, chunk: bytes) -> bytes:
        """The bytes of a stream to pass on now, with every served `model` rewritten; a possible match's start kept back."""
        data = self._carry + chunk if self._carry else chunk
        if data.endswith(b"\n"):
            hold = len(data)
            if self._needle not in data:
                self._carry = b""
                return data
        else:
            hold = data.find(b'"', max(0, len(data) - self._hold))
            if hold < 0:
                hold = len(data)
        parts: list[bytes] = []
        pos = 0
        for m in self._pattern.finditer(data):
            if m.start() >= hold:
                break
            parts.append(data[pos:m.start()])
            parts.append(self._with)
            pos = m.end()
        hold = max(hold, pos)
        parts.append(data[pos:hold])
        self._carry = data[hold:]
        return b"".join(parts)

    def rest(self) -> bytes:
        """What was kept back, rewritten: the end of a stream (or of its last part)."""
        data, self._carry = self._carry, b""
        return self._pattern.sub(self._with, data) if data else b""
