"""The router's client to engines: one POST of a JSON body, the answer passed back.

Why not aiohttp's ClientSession, which the router used first: profiled under
load, its client side (request and response objects, header multidicts,
StreamReader, timers, trace hooks) cost about as much CPU per request as the
whole rest of the router, and the router needs almost none of what it offers.
What it needs is narrow: keep-alive connections per engine, one write per
request, the status, a few headers, the body as the bytes that arrived (a
stream chunk by chunk), back-pressure when a client reads slowly, and errors
that say whether the request may be retried elsewhere (errors.py, the tree
drawn at its top).

An engine is a peer the router does not trust (a GPU node can be
compromised, an engine can be buggy): nothing it sends is held without a
bound. Its head is capped as the router's own server caps a client's, the
wait for it is bounded for every request (`headers_timeout`), a whole answer
is read up to a cap given by the caller (`Response.read(limit)`), and nothing
is ever followed: a redirect is just a status the caller refuses.

One module a job, each knowing only those below it:

    pool.py        Pool: connections per engine, opened on demand, bounded, kept alive; `post`
    connection.py  one connection: a request out, its answer in, the timers that bound the wait
    parser.py      the answer's bytes parsed (httptools), its head held to the caps
    response.py    Response: the body read whole (up to a cap) or chunk by chunk, with back-pressure
    outgoing.py    Target (an endpoint URL parsed once) and the request's bytes written
    errors.py      what can go wrong, and whether another endpoint may be tried
"""
from __future__ import annotations

from .errors import BadEndpointURL, ConnectFailed, OutOfBounds, UpstreamBroken, UpstreamError, UpstreamTimeout
from .outgoing import Target, parse_target
from .pool import Pool
from .response import Response

__all__ = [
    "BadEndpointURL",
    "ConnectFailed",
    "OutOfBounds",
    "Pool",
    "Response",
    "Target",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamTimeout",
    "parse_target",
]
