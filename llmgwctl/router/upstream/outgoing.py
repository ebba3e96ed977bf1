"""What goes to an engine: where (`Target`, parsed once from an endpoint's URL) and the request's bytes.

Every request is one POST of a JSON body (or, for a stored response's
routes, a GET or DELETE of the same shape, usually with an empty body). The client's Authorization is the
gateway's credential and is not passed on; no Accept-Encoding is sent, so
engines answer uncompressed and the router never decompresses.
"""
from __future__ import annotations

import asyncio
from typing import NamedTuple
from urllib.parse import urlsplit

from .errors import BadEndpointURL

# Parsed endpoint URLs kept; past this they are parsed anew (a few µs each).
TARGETS_KEPT = 1024
# A body longer than this is written beside its head rather than joined to it:
# joining copies the body (an embeddings batch, a chat with images: megabytes)
# for a few hundred bytes of head. uvloop (and asyncio from Python 3.12) sends
# the two with one writev; asyncio 3.11 joins them itself, as we would have.
# A shorter body is joined: one buffer is one write call, and copying a few KiB
# costs less than the second buffer's bookkeeping.
JOIN_BELOW = 64 * 1024


class Target(NamedTuple):
    """Where an endpoint's requests go, parsed once from its URL (see `parse_target`)."""

    host: str
    port: int
    host_header: bytes      # what the Host header says: the URL's host[:port], IDNA-encoded
    path_prefix: bytes      # the URL's path, prepended to every request's (b"" for most engines)
    tls: bool               # https: verified against the system's trust store


def parse_target(base_url: str) -> Target:
    """The `Target` of an endpoint's URL; BadEndpointURL if it is not an http(s) URL with a host and a valid port."""
    try:
        parts = urlsplit(base_url)
        port = parts.port       # ValueError when it is not a number in 0-65535
        host_header = parts.netloc.encode("idna")
    except (ValueError, UnicodeError) as exc:
        raise BadEndpointURL(f"not a usable endpoint URL: {base_url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadEndpointURL(f"not an http(s) URL: {base_url!r}")
    if not parts.hostname:
        raise BadEndpointURL(f"no host in the endpoint URL {base_url!r}")
    https = parts.scheme == "https"
    return Target(parts.hostname, port or (443 if https else 80), host_header,
                  parts.path.rstrip("/").encode(), https)


class Targets:
    """Endpoint URLs parsed once each, at most TARGETS_KEPT of them (replicas come and go, each at a new URL)."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[str, Target] = {}

    def get(self, base_url: str) -> Target:
        """`base_url`'s Target; BadEndpointURL if it cannot be an engine's."""
        target = self._kept.get(base_url)
        if target is None:
            if len(self._kept) >= TARGETS_KEPT:
                self._kept.clear()
            target = self._kept[base_url] = parse_target(base_url)
        return target


def request_head(target: Target, path: str, length: int, headers: bytes = b"", method: bytes = b"POST") -> bytes:
    """The head of a POST (or `method`) of `length` bytes of JSON to `path` on `target`; `headers` are whole lines to add."""
    return b"%s %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
        method, target.path_prefix, path.encode("utf-8", "surrogateescape"), target.host_header, length, headers)


def write_request(transport: asyncio.WriteTransport, head: bytes, body: bytes) -> None:
    """Hand the request to the transport: one buffer for a short body, the two side by side for a long one."""
    if len(body) < JOIN_BELOW:
        transport.write(head + body)
    else:
        transport.writelines((head, body))
