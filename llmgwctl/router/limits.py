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
- large bodies held at once: `BodyBudget`, per client address and in all
  (429 / 503), charged before a declared body is read and before a
  compressed one is inflated;
- a body costly to parse (many values): parsed in a worker process, never on
  the loop, a bounded number at a time (`jsonbody`);
- the model name: at most `errors.MAX_NAME_CHARS` (400) before it is looked
  up; an error quotes at most `errors.QUOTE_CHARS` of anything a client sent;
- the routes: only those in `routes.TABLE` and the catalog's reach an engine;
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


class BudgetFull(RouterError):
    """A large body would take its client, or the router, past `BodyBudget`'s bytes; `per_client` says which."""

    def __init__(self, per_client: bool, limit: int):
        super().__init__(f"over the large-body budget of {limit} bytes{' for one client' if per_client else ''}")
        self.per_client = per_client
        self.limit = limit


class BodyBudget:
    """Bytes of large request bodies held by requests in flight, per client address and in all.

    Only bodies of `large` bytes or more are counted: small ones are bounded
    by the connection limit times their size, which is little. A request
    holds its charge until it is answered (the body is kept for retries, and
    aiohttp keeps it with the request), so sixteen bodies just under the size
    limit cannot all be held at once; the one past the budget is refused
    before it is read (when declared) or inflated.
    """

    __slots__ = ("large", "per_client", "total", "_held", "_by_client")

    def __init__(self, large: int, per_client: int, total: int):
        self.large = large
        self.per_client = per_client
        self.total = total
        self._held = 0
        self._by_client: dict[str, int] = {}

    def take(self, client: str, size: int) -> int:
        """Charge `size` bytes to `client` and return the charge (0 for a small body); BudgetFull if over."""
        if size < self.large:
            return 0
        mine = self._by_client.get(client, 0)
        if mine + size > self.per_client:
            raise BudgetFull(True, self.per_client)
        if self._held + size > self.total:
            raise BudgetFull(False, self.total)
        self._by_client[client] = mine + size
        self._held += size
        return size

    def give_back(self, client: str, size: int) -> None:
        if not size:
            return
        self._held -= size
        left = self._by_client.get(client, 0) - size
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)

    def held(self) -> int:
        return self._held


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
