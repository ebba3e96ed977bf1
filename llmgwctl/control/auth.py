"""Control API authentication: loopback by default, bearer tokens beyond it.

The rules (`llmgwctl serve --control HOST:PORT --token-file F [--agent-token-file G]`):

- Bound to a loopback address and given no token, the control API is open:
  only processes on this machine can reach it.
- Bound anywhere else, a token is required: `check_bind` refuses to start
  without one, because the control API can rewrite the catalog and so decide
  what runs on every GPU of the fleet.
- With a token, every request needs `Authorization: Bearer <token>`, except
  `/healthz` and `/readyz`, which say only "up" and "settled" and are what
  load balancers and orchestrators probe without credentials, and the web
  console's static files (`/`, `/ui/...`), which hold no data: the page asks
  for the token and sends it as this same header (see `webui`).
- The agent token (`--agent-token-file`) is the fleet's shared secret. As a
  bearer token it is what standalone routers present: it may follow the watch
  streams, report usage and wake models, but not apply a catalog, read status,
  or act as a node.
- A node authenticates as *itself* with a node token,
  `llmgwn.<node>.<hex HMAC-SHA256(agent secret, "node:" + node)>`, minted by the
  operator (`llmgwctl token node NAME --agent-token-file F`, see `node_token`).
  The controller keeps no database, so it verifies one by recomputing the MAC
  for the node the token names: nothing to store, nothing to sync, and a
  stolen node token speaks for that one node only. It is good on
  `/api/v1/agents/{node}/...` of its own node and nowhere else; for another
  node it gets 403 saying whose token it is. The plain agent token there gets
  403 too, with how to mint the node token: it used to be accepted, and a
  silent 401 would leave an operator upgrading a fleet guessing. Revoking one
  node means rotating the agent secret (every node token changes with it).
- The admin token works on every route, the agents' included.
- The scheme is case-insensitive (RFC 9110 11.1): `bearer x` is `Bearer x`.
- A missing or wrong token gets 401 (a token not good for its node 403)
  before any handler runs, so it changes nothing. Tokens are compared with `hmac.compare_digest` against every
  configured token (no early exit that would tell which one nearly matched),
  and are never logged: a refusal logs the route, the address and whether a
  token was sent at all.

It must not know what the routes do; `ROUTER_PREFIXES` and `NODE_PREFIX` name
the ones routers and agents use.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
import logging
import os
import stat
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from .errors import ControlError

log = logging.getLogger("llmgw.control.auth")

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# The web console's static files (control.webui): code, no data, and the page
# must load before it can ask for a token. Matched whole -- one file name, no
# "/" or ".." -- so no API path can pass for one.
CONSOLE_PATH = re.compile(r"/(?:ui(?:/(?:[a-z0-9-]+\.(?:html|js|css|svg))?)?)?\Z")
# Routes a standalone router calls with the agent token: the watch streams,
# its usage reports (idle stop and drain count its traffic) and wake.
ROUTER_PREFIXES = ("/api/v1/watch/", "/api/v1/wake", "/api/v1/usage")
# Watch streams that are not a router's: the console's status stream shows
# what `/api/v1/status` shows, so it takes the admin token as status does.
ADMIN_WATCHES = frozenset({"/api/v1/watch/status"})
# `/api/v1/agents/{node}/...`: reports and the desired long-poll, one node's each.
NODE_PREFIX = "/api/v1/agents/"
# Every route an agent or a router may call (kept for readers of the old name).
FLEET_PREFIXES = (NODE_PREFIX, *ROUTER_PREFIXES)
NODE_TOKEN_PREFIX = "llmgwn."
# Shorter than this is guessable by someone who can reach the port and try; 16
# characters of `openssl rand -hex 32` output are already 64 bits.
MIN_TOKEN_LENGTH = 16


class TokenError(ControlError):
    """A token file cannot be used, or a bind address needs a token; the message says what to do."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False        # a host name: it may resolve to anything


def check_bind(host: str, token: str | None) -> None:
    """TokenError if `host` reaches beyond this machine and no token is configured."""
    if token is None and not is_loopback(host):
        raise TokenError(f"the control API would listen on {host!r}, beyond this machine, without a token; "
                         "give --token-file FILE (e.g. openssl rand -hex 32 > FILE; chmod 600 FILE) "
                         "or bind it to 127.0.0.1")


def read_token_file(path: str | os.PathLike, option: str = "--token-file") -> str:
    """The token in `path` (surrounding whitespace stripped); TokenError if unreadable, empty or short."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise TokenError(f"{option} {path}: cannot read: {exc.strerror or exc}") from None
    if not token:
        raise TokenError(f"{option} {path}: the file is empty")
    if len(token) < MIN_TOKEN_LENGTH:
        raise TokenError(f"{option} {path}: the token is {len(token)} characters; use at least "
                         f"{MIN_TOKEN_LENGTH} (openssl rand -hex 32)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s can be read by other users; chmod 600 it", option, path)
    return token


def check_node_name(node: str) -> None:
    """TokenError unless `node` can be a node's name: one URL path segment, printable, no spaces."""
    if not node or len(node) > 253 or any(c in node for c in "/\\?#%") or not node.isprintable() \
            or any(c.isspace() for c in node):
        raise TokenError(f"{node!r} cannot be a node name: use letters, digits, '.', '-' or '_' "
                         "(a host name is what --node defaults to)")


def _node_mac(secret: bytes, node: str) -> str:
    # "node:" keeps these MACs apart from any other use of the secret later
    # (another kind of token signed with it cannot pass for a node token).
    return hmac.new(secret, b"node:" + node.encode("utf-8", "surrogateescape"), "sha256").hexdigest()


def node_token(agent_secret: str, node: str) -> str:
    """The token that lets an agent act as `node`: `llmgwn.<node>.<hex MAC>`."""
    check_node_name(node)
    return f"{NODE_TOKEN_PREFIX}{node}.{_node_mac(agent_secret.encode(), node)}"


def _split_bearer(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip().encode("utf-8", "surrogateescape")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request may not run: 401 (no credential good here) or 403 (a good one, not for this)."""

    status: int
    message: str


_NEED_TOKEN = Refusal(401, "a valid token is required: send 'Authorization: Bearer <token>' "
                           "(llmgwctl reads it from $LLMGW_TOKEN or $LLMGW_TOKEN_FILE)")


class ControlAuth:
    """The tokens in force. `admin=None` means no authentication at all (loopback only)."""

    def __init__(self, admin: str | None = None, agent: str | None = None):
        if agent is not None and admin is None:
            raise TokenError("an agent token needs an admin token too (--token-file): without one every "
                             "other route would be open")
        self._admin = admin.encode() if admin else None
        self._agent = agent.encode() if agent else None

    @property
    def enabled(self) -> bool:
        return self._admin is not None

    def allowed(self, path: str, authorization: str | None, node: str | None = None) -> bool:
        return self.check(path, authorization, node) is None

    def check(self, path: str, authorization: str | None, node: str | None = None) -> Refusal | None:
        """None when the request may run; else what to answer.

        `node` is the `{node}` of an `/api/v1/agents/{node}/...` route (the
        router's match, already decoded); without it the path's own segment is used.
        """
        if self._admin is None or path in OPEN_PATHS or CONSOLE_PATH.match(path):
            return None
        presented = _split_bearer(authorization)
        if presented is None:
            return _NEED_TOKEN
        # Both comparisons always run: which token nearly matched must not show in the timing.
        admin_ok = hmac.compare_digest(presented, self._admin)
        agent_ok = self._agent is not None and hmac.compare_digest(presented, self._agent)
        if admin_ok:
            return None
        if path.startswith(NODE_PREFIX):
            target = node if node is not None else path[len(NODE_PREFIX):].split("/", 1)[0]
            if agent_ok:
                return Refusal(403, "the agent token cannot act as a node: give each agent its own node token "
                                    f"(llmgwctl token node {target or 'NAME'} --agent-token-file FILE) "
                                    "in its --token-file")
            claimed = self._node_of(presented)
            if claimed is None:
                return _NEED_TOKEN
            if claimed != target:
                return Refusal(403, f"this is node {claimed!r}'s token; it may not report or read node "
                                    f"{target!r} (each agent reports as the node its token names)")
            return None
        if agent_ok and path.startswith(ROUTER_PREFIXES) and path not in ADMIN_WATCHES:
            return None
        return _NEED_TOKEN

    def _node_of(self, presented: bytes) -> str | None:
        """The node a well-formed, genuine node token names; None for anything else."""
        if self._agent is None or not presented.startswith(NODE_TOKEN_PREFIX.encode()):
            return None
        node_b, _, mac = presented[len(NODE_TOKEN_PREFIX):].rpartition(b".")
        try:
            node = node_b.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if not node or not hmac.compare_digest(mac, _node_mac(self._agent, node).encode()):
            return None
        return node

    def middleware(self, count: Callable[[str, int], None] = lambda route, code: None):
        """aiohttp middleware: 401 before the handler when the token is missing or wrong; counts every request."""

        @web.middleware
        async def authenticate(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            header = request.headers.get("Authorization")
            refusal = self.check(request.path, header, request.match_info.get("node"))
            if refusal is not None:
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote,
                            "no bearer token" if not header else
                            "wrong token" if refusal.status == 401 else "token not good for this route",
                            extra={"event": "control-unauthorized"})
                count(route, refusal.status)
                kind = "authentication_error" if refusal.status == 401 else "permission_error"
                return web.json_response({"error": {"message": refusal.message, "type": kind, "code": refusal.status}},
                                         status=refusal.status,
                                         headers={"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None)
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                count(route, exc.status)
                raise
            count(route, resp.status)
            return resp

        return authenticate
