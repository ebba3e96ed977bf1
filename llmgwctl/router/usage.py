"""The token counts an engine reports in its answer's `usage` block, read off the bytes as they pass.

The router never parses an answer: `usage_tokens` finds the two counts in a
whole reply or one SSE chunk with two small regular expressions, and
`StreamUsage` follows a stream chunk by chunk. What they find is counted in
`observability.metrics` (per endpoint and per key) and written to the access
log; metrics only counts what it is handed.
"""
from __future__ import annotations

import re

__all__ = ["StreamUsage", "usage_tokens"]

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
