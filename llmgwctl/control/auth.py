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
  silent 401 would leave an operator upgrading a fleet guessing.
- A node token carries its claims (`llmgwctl token node NAME --pools h100
  --max-gpus 8 [--advertise-host H] [--serial N]`), MAC'd with the agent
  secret like the name: `llmgwn.<node>.<claims>.<hex HMAC-SHA256(agent secret,
  "node-claims:" + node + "\n" + claims)>`, `<claims>` unpadded base64url of
  compact JSON. The controller keeps no database: what a node may claim is in
  its own token, and `NodeClaims.bound` cuts its reports down to it. A token
  from before claims (`llmgwn.<node>.<mac>`) still authenticates, and claims
  what one minted with no option does -- no pool, 8 GPUs, its own address --
  unless serve runs with `--legacy-node-tokens`, which lets such tokens claim
  what their reports say for the time a fleet takes to get new tokens.
- Revoking one node: `serve --node-revocations FILE` lists `NODE [SERIAL]`
  lines; a token of NODE with a serial below SERIAL (every token of NODE when
  no serial is given) gets 401 saying so, within two seconds of the edit
  (`follow_revocations`). `llmgwctl token node NODE --serial SERIAL` mints the
  replacement; no other node's token changes.
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

import base64
import binascii
import hmac
import ipaddress
import json
import logging
import os
import re
import stat
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from aiohttp.typedefs import Middleware

from ..contracts import UNBOUNDED, NodeClaims
from ..contracts.claims import DEFAULT_MAX_GPUS
from ..httpserver import error_document
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


def read_token_file(path: str | os.PathLike[str], option: str = "--token-file") -> str:
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


def _claims_mac(secret: bytes, node: str, claims: str) -> str:
    # Its own prefix: a token before claims (MAC of "node:" + name) can never
    # pass for one with claims, whatever dots the node's name holds.
    return hmac.new(secret, b"node-claims:" + node.encode("utf-8", "surrogateescape") + b"\n"
                    + claims.encode("ascii"), "sha256").hexdigest()


# Bounds of what a token can carry, so a token is a line an operator can copy:
# a node's pools are a handful of labels; the GPUs as many as a report may list.
MAX_TOKEN_POOLS = 64
MAX_TOKEN_GPUS = 256
MAX_SERIAL = 2**31 - 1


def node_token(agent_secret: str, node: str, *, pools: tuple[str, ...] | None = None,
               max_gpus: int | None = None, advertise_host: str = "", serial: int = 0) -> str:
    """The token that lets an agent act as `node`, and claim only `pools`, `max_gpus` GPUs and `advertise_host`.

    `pools=None` and the rest left as they are mints the token of before
    claims, `llmgwn.<node>.<hex MAC>` (kept for tests and for an agent secret
    shared with controllers older than claims); anything else mints
    `llmgwn.<node>.<claims>.<hex MAC>`. TokenError for a claim a token cannot hold.
    """
    check_node_name(node)
    secret = agent_secret.encode()
    if pools is None and max_gpus is None and not advertise_host and not serial:
        return f"{NODE_TOKEN_PREFIX}{node}.{_node_mac(secret, node)}"
    labels = sorted(set(pools or ()))
    if len(labels) > MAX_TOKEN_POOLS or any(not p or len(p) > 253 or not p.isprintable() for p in labels):
        raise TokenError(f"--pools: at most {MAX_TOKEN_POOLS} labels, each 1-253 printable characters")
    gpus = DEFAULT_MAX_GPUS if max_gpus is None else max_gpus
    if not 0 <= gpus <= MAX_TOKEN_GPUS:
        raise TokenError(f"--max-gpus {gpus}: must be 0 to {MAX_TOKEN_GPUS}")
    if not 0 <= serial <= MAX_SERIAL:
        raise TokenError(f"--serial {serial}: must be 0 to {MAX_SERIAL}")
    if advertise_host and (len(advertise_host) > 253 or not advertise_host.isprintable()
                           or any(c.isspace() or c in "/@?#" for c in advertise_host)):
        raise TokenError(f"--advertise-host {advertise_host!r}: must be a host name or an IP address")
    doc = {"p": labels, "g": gpus, "s": serial, **({"h": advertise_host} if advertise_host else {})}
    claims = base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()).rstrip(b"=").decode()
    return f"{NODE_TOKEN_PREFIX}{node}.{claims}.{_claims_mac(secret, node, claims)}"


def _decode_claims(text: str) -> NodeClaims | None:
    """The claims a genuine token carries (its MAC checked already); None if they do not parse."""
    try:
        doc = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        pools, gpus, serial, host = doc["p"], doc["g"], doc["s"], doc.get("h", "")
        if not (isinstance(pools, list) and all(isinstance(p, str) for p in pools) and type(gpus) is int
                and type(serial) is int and isinstance(host, str)):
            return None
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None
    return NodeClaims(pools=frozenset(pools), max_gpus=gpus, advertise_host=host, serial=serial)


def parse_revocations(text: str, origin: str = "--node-revocations") -> Mapping[str, int | None]:
    """`NODE [SERIAL]` per line (`#` comments): node -> the lowest serial still good (None: none is).

    TokenError naming the line for anything else: a list that cannot be read
    is not applied, and the last one read stays in force.
    """
    out: dict[str, int | None] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise TokenError(f"{origin}:{n}: expected 'NODE [SERIAL]', got {line.strip()[:100]!r}")
        try:
            check_node_name(words[0])
        except TokenError as exc:
            raise TokenError(f"{origin}:{n}: {exc}") from None
        try:
            serial = int(words[1]) if len(words) == 2 else None
        except ValueError:
            raise TokenError(f"{origin}:{n}: the serial {words[1][:20]!r} is not a whole number") from None
        if serial is not None and not 0 <= serial <= MAX_SERIAL + 1:
            raise TokenError(f"{origin}:{n}: the serial {serial} is out of range")
        # A node listed twice: the stricter line holds (None, all revoked, is strictest).
        if words[0] in out:
            prev = out[words[0]]
            serial = None if prev is None or serial is None else max(prev, serial)
        out[words[0]] = serial
    return MappingProxyType(out)


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

    def __init__(self, admin: str | None = None, agent: str | None = None, *, legacy_node_tokens: bool = False):
        if agent is not None and admin is None:
            raise TokenError("an agent token needs an admin token too (--token-file): without one every "
                             "other route would be open")
        self._admin = admin.encode() if admin else None
        self._agent = agent.encode() if agent else None
        # serve --legacy-node-tokens: a token from before claims claims what its reports say.
        self.legacy_node_tokens = legacy_node_tokens
        # node -> the lowest serial still good, None: every token of it revoked (follow_revocations swaps it whole).
        self.revocations: Mapping[str, int | None] = MappingProxyType({})

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
            found = self._node_of(presented)
            if found is None:
                return _NEED_TOKEN
            claimed, claims = found
            revoked = self._revoked(claimed, claims)
            if revoked is not None:
                return revoked
            if claimed != target:
                return Refusal(403, f"this is node {claimed!r}'s token; it may not report or read node "
                                    f"{target!r} (each agent reports as the node its token names)")
            return None
        if agent_ok and path.startswith(ROUTER_PREFIXES) and path not in ADMIN_WATCHES:
            return None
        return _NEED_TOKEN

    def _revoked(self, node: str, claims: NodeClaims) -> Refusal | None:
        if node not in self.revocations:
            return None
        lowest = self.revocations[node]
        if lowest is not None and claims.serial >= lowest:
            return None
        which = "every token of the node is" if lowest is None else f"serials below {lowest} are"
        fix = "" if lowest is None else f"; a new one: llmgwctl token node {node} --serial {lowest} ..."
        return Refusal(401, f"this token of node {node!r} (serial {claims.serial}) is revoked: {which} "
                            f"refused by the controller's --node-revocations list{fix}")

    def _node_of(self, presented: bytes) -> tuple[str, NodeClaims] | None:
        """The node a well-formed, genuine node token names, and what it may claim; None for anything else.

        Both readings of the token are checked, each against its own MAC: with
        claims (`<node>.<claims>.<mac>`) and from before them (`<node>.<mac>`),
        since a node's name may itself hold dots.
        """
        if self._agent is None or not presented.startswith(NODE_TOKEN_PREFIX.encode()):
            return None
        try:
            rest = presented[len(NODE_TOKEN_PREFIX):].decode("utf-8")
        except UnicodeDecodeError:
            return None
        whole, _, mac = rest.rpartition(".")
        node, _, claims = whole.rpartition(".")
        mac_b = mac.encode()
        old_ok = bool(whole) and hmac.compare_digest(mac_b, _node_mac(self._agent, whole).encode())
        new_ok = (bool(node) and claims.isascii()
                  and hmac.compare_digest(mac_b, _claims_mac(self._agent, node, claims).encode()))
        if new_ok:
            decoded = _decode_claims(claims)
            return (node, decoded) if decoded is not None else None
        if old_ok:
            legacy = NodeClaims(pools=None, max_gpus=None, advertise_host=None, legacy=True) \
                if self.legacy_node_tokens else NodeClaims(legacy=True)
            return whole, legacy
        return None

    def claims(self, authorization: str | None) -> NodeClaims:
        """What the request's credentials let a node claim: UNBOUNDED for the operator's (admin, or no auth).

        Called by a handler the middleware already let through, so a node token here is genuine and its node's.
        """
        if self._admin is None:
            return UNBOUNDED
        presented = _split_bearer(authorization)
        if presented is None or hmac.compare_digest(presented, self._admin):
            return UNBOUNDED
        found = self._node_of(presented)
        # Anything else was refused before the handler ran; nothing is the safe reading if it were not.
        return found[1] if found is not None else NodeClaims(max_gpus=0)

    def middleware(self, count: Callable[[str, int], None] = lambda route, code: None) -> Middleware:
        """aiohttp middleware: 401 before the handler when the token is missing or wrong; counts every request."""

        @web.middleware
        async def authenticate(request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:

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
                return web.json_response(error_document(refusal.message, kind, refusal.status), status=refusal.status,
                                         headers={"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None)
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                count(route, exc.status)
                raise
            count(route, resp.status)
            return resp

        return authenticate
