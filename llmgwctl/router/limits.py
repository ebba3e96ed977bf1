"""Input limits for everything a stranger can reach on the router's port.

What bounds what (defaults and their reasons are in `RouterConfig`):

- body size: `max_body_bytes`, 413 before the body is read when the client
  declares it, and while reading when it does not;
- a slow body: `body_timeout` for the whole body once the headers are in;
- headers: aiohttp's parser limits, passed by `llmgwctl.httpserver.server_options`
  (request line and each header line at most 8 KiB, at most 128 header lines -> 400);
- slow headers (slowloris): a connection must finish its request headers
  within `client_idle_timeout` of opening (or of its previous response):
  aiohttp's keep-alive timer closes a connection still waiting for a complete
  request when it fires, and this is the value it is given;
- JSON nesting: `check_depth` (-> 400) before anything walks the document;
- the request target: `check_target` (-> 400) before the body is read: only a
  normalised origin-form path is routed, and an engine gets that very target;
- compressed bodies: inflated by `llmgwctl.httpbody`, stopping at
  `max_body_bytes` as they inflate (413), one step of memory at a time;
- connections per client address: `llmgwctl.httpserver.ConnectionGuard`,
  installed on the aiohttp server: the connection past the limit is answered
  429 and closed at once, so one address cannot hold every socket the router has;
- a streaming client that stops reading: `client_write_timeout`, then the
  connection is aborted and the engine's slot freed (server.py);
- a stream whose engine goes silent: `upstream_idle_timeout` (the upstream
  pool's idle timer, on streams only), 504 before the first byte, an error event
  after. A whole reply is bounded by its client, whose disconnect cancels the
  upstream request.

Not here: the control API's long-polls are capped by the control API itself
(30 s, `reconciler.LONG_POLL`), and its body size by `MAX_APPLY_BYTES`.

The two bounds the control API shares (header limits, connections per
address) live in `llmgwctl.httpserver`; this module keeps what only the
router's request path checks.

A request to the router costs the strangers nothing they can multiply: every
wait is bounded in time, every buffer in size, and the number of both per
address.

It must not know about models or endpoints.
"""
from __future__ import annotations

from typing import Any

from .errors import RouterError


class DepthError(RouterError, ValueError):
    pass


class PathError(RouterError, ValueError):
    pass


def check_target(target: str, prefix: str = "/v1/") -> None:
    """PathError unless `target` (a request's raw target) is a normalised path under `prefix`.

    The router forwards the target as the client sent it, so what an engine
    sees must be what was routed: an absolute-form target
    (`http://host/v1/...`), a segment that is empty or starts with a dot
    (`/v1/../../admin/shutdown`), a backslash, or an encoded dot, slash,
    backslash or NUL (`/v1/%2e%2e/...`, which a framework on the engine may
    decode after its routing) is refused. No OpenAI route has any of them.
    The query string is not a path and is not checked. A few substring tests:
    nothing is allocated for the usual target but its path part.
    """
    path = target.partition("?")[0]
    if not path.startswith(prefix):
        raise PathError(f"the request path must start with {prefix}" if path.startswith("/") else
                        "the request target must be a path (origin-form: /v1/...), not an absolute URL")
    if "/." in path or "//" in path or "\\" in path:
        raise PathError("the request path must be normalised: no '.' or '..' segment, no empty segment, "
                        "no backslash")
    if "%" in path:
        low = path.lower()
        if "%2e" in low or "%2f" in low or "%5c" in low or "%00" in low:
            raise PathError("the request path must not encode a dot, a slash, a backslash or NUL")


def check_depth(body: bytes, doc: Any, limit: int) -> None:
    """DepthError if `doc` (parsed from `body`) nests lists/objects deeper than `limit`.

    Fast path: a body with fewer than `limit` brackets cannot nest that deep, and
    counting bytes runs at memory speed; only larger bodies are walked, and the
    walk stops at the first container past the limit.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise DepthError(f"the request body nests JSON deeper than {limit} levels")
        if type(node) is dict:
            stack.extend((v, depth + 1) for v in node.values() if type(v) in (dict, list))
        elif type(node) is list:
            stack.extend((v, depth + 1) for v in node if type(v) in (dict, list))
