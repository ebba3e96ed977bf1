"""The token counts an engine reports in its answer's `usage` block, read off the bytes as they pass.

The router never parses an answer: `usage_tokens` finds the two counts in a
whole reply or one SSE chunk with two small regular expressions, and
`StreamUsage` follows a stream chunk by chunk. What they find is counted in
`observability.metrics` (per endpoint and per key) and written to the access
log; metrics only counts what it is handed.

Each route says how its usage is read (`routes.Route.usage`, a `Reading`):
OpenAI's `prompt_tokens`/`completion_tokens` (`OPENAI`), or Anthropic
Messages' `input_tokens`/`output_tokens` (`MESSAGES`: the whole reply's
`usage`, and in a stream `message_start`'s input and `message_delta`'s
output), both counted as the same prompt and completion tokens.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MESSAGES", "NONE", "OPENAI", "MessagesStreamUsage", "Reading", "StreamUsage", "messages_tokens",
           "usage_tokens"]

# The usage block is at the end of a reply (and in the last chunk of a stream
# that asked for it); these read the two counts without parsing the reply.
# A chat's or a completion's are prompt_tokens and completion_tokens, a
# Responses answer's (and its stream's response.completed) input_tokens and output_tokens.
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
# usage with its *_details sub-objects is well under this many bytes.
_USAGE_SPAN = 600


def usage_tokens(data: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from an OpenAI-shaped reply or SSE chunk, or None if it has no usage."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    tail = data[at:at + _USAGE_SPAN]
    p = _PROMPT.search(tail)
    if p is None:
        return None
    c = _COMPLETION.search(tail)
    return int(p.group(1)), int(c.group(1)) if c else 0


class StreamUsage:
    """The token counts of a stream, read from its bytes as they pass.

    The last usage block seen wins: engines that put usage on every chunk
    (vLLM's continuous_usage_stats) send running totals, so adding them up
    would count a stream many times over. A line cut between two reads of the
    socket is carried over (its last `_CARRY` bytes), so a usage block split
    across reads is still read once its end arrives.
    """

    __slots__ = ("usage", "_carry")

    # A usage line (an SSE chunk with empty choices) is a few hundred bytes.
    _CARRY = 2048

    def __init__(self) -> None:
        self.usage: tuple[int, int] | None = None
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        seen = self._carry + chunk if self._carry else chunk
        if b'"usage"' in seen:
            found = usage_tokens(seen)
            if found is not None:
                self.usage = found
        if chunk.endswith(b"\n"):
            self._carry = b""
        else:
            self._carry = seen[seen.rfind(b"\n") + 1:][-self._CARRY:]


# -- Anthropic Messages -------------------------------------------------------------------------

# Anthropic counts the prompt in three parts: `input_tokens` is only what
# was neither written to nor read from its prompt cache, so the prompt is
# their sum. A quote before each name keeps `input_tokens` from matching
# inside `cache_read_input_tokens`.
_INPUT = re.compile(rb'"input_tokens"\s*:\s*(\d+)')
_CACHE_WRITE = re.compile(rb'"cache_creation_input_tokens"\s*:\s*(\d+)')
_CACHE_READ = re.compile(rb'"cache_read_input_tokens"\s*:\s*(\d+)')
_OUTPUT = re.compile(rb'"output_tokens"\s*:\s*(\d+)')
_MESSAGES_FIELDS = (_INPUT, _CACHE_WRITE, _CACHE_READ, _OUTPUT)


def _messages_fields(block: bytes) -> list[int | None] | None:
    """The four counts of the `usage` block `block` starts with (None each where absent), or None if it has neither."""
    found = [m.group(1) if (m := p.search(block)) is not None else None for p in _MESSAGES_FIELDS]
    if found[0] is None and found[3] is None:
        return None
    return [int(v) if v is not None else None for v in found]


def messages_tokens(data: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from a Messages reply's `usage`: input (with the cached parts) and output."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    fields = _messages_fields(data[at:at + _USAGE_SPAN])
    if fields is None:
        return None
    return sum(v or 0 for v in fields[:3]), fields[3] or 0


class MessagesStreamUsage(StreamUsage):
    """A Messages stream's counts: `message_start` says the input, `message_delta` the output so far.

    Each count is the last one seen of its own: the input arrives first and
    alone, the output as a running total at the end (and an engine may
    repeat the input there, as vLLM does). One read may hold both events (a
    short stream), so every usage block in it is read, in order.
    """

    __slots__ = ("_fields",)

    def __init__(self) -> None:
        super().__init__()
        self._fields: list[int | None] = [None, None, None, None]

    def feed(self, chunk: bytes) -> None:
        seen = self._carry + chunk if self._carry else chunk
        at = seen.find(b'"usage"')
        while at >= 0:
            after = seen.find(b'"usage"', at + 7)
            found = _messages_fields(seen[at:min(at + _USAGE_SPAN, after) if after >= 0 else at + _USAGE_SPAN])
            if found is not None:
                fields = self._fields
                for i, v in enumerate(found):
                    if v is not None:
                        fields[i] = v
                self.usage = sum(v or 0 for v in fields[:3]), fields[3] or 0
            at = after
        if chunk.endswith(b"\n"):
            self._carry = b""
        else:
            self._carry = seen[seen.rfind(b"\n") + 1:][-self._CARRY:]


# -- how a route's usage is read --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Reading:
    """How one API's answers say what they cost: a whole reply's counts, and a reader for its stream."""

    whole: Callable[[bytes], tuple[int, int] | None]
    stream: Callable[[], StreamUsage]


class _Nothing(StreamUsage):
    """A stream of an API that reports no usage: nothing read."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> None:
        pass


OPENAI = Reading(usage_tokens, StreamUsage)
MESSAGES = Reading(messages_tokens, MessagesStreamUsage)
# An answer that costs no generation (count_tokens says a count, it does not spend one).
NONE = Reading(lambda data: None, _Nothing)
