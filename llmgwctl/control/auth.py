"""Control API authentication: loopback by default, bearer tokens beyond it.

The rules (`llmgwctl serve --control HOST:PORT --token-file F [--agent-token-file G]`):

- Bound to a loopback address and given no token, the control API is open:
  only processes on this machine can reach it.
- Bound anywhere else, a token is required: `check_bind` refuses to start
  without one, because the control API can rewrite the catalog and so decide
  what runs on every GPU of the fleet.
- With a token, every request needs `Authorization: Bearer <token>`, except
  `/healthz` and `/readyz`, which say only "up" and "settled" and are what
  load balancers and orchestrators probe without credentials.
- Agents (and standalone routers) may present their own token
  (`--agent-token-file`), so a node holds a credential that can report and
  follow its desired list but cannot apply a catalog or read status. The
  admin token works on those routes too.
- A missing or wrong token gets 401 before any handler runs, so it changes
  nothing. Tokens are compared with `hmac.compare_digest` against every
  configured token (no early exit that would tell which one nearly matched),
  and are never logged: a refusal logs the route, the address and whether a
  token was sent at all.

It must not know what the routes do; `FLEET_PREFIXES` names the ones agents
and routers use.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import stat
from typing import Awaitable, Callable

from aiohttp import web

from .errors import ControlError

log = logging.getLogger("llmgw.control.auth")

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# Routes an agent or a standalone router calls: reports, the desired long-poll,
# the watch streams and wake.
FLEET_PREFIXES = ("/api/v1/agents/", "/api/v1/watch/", "/api/v1/wake")
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

    def allowed(self, path: str, authorization: str | None) -> bool:
        if self._admin is None or path in OPEN_PATHS:
            return True
        if not authorization or not authorization.startswith("Bearer "):
            return False
        presented = authorization[7:].strip().encode("utf-8", "surrogateescape")
        # Both comparisons always run: which token nearly matched must not show in the timing.
        admin_ok = hmac.compare_digest(presented, self._admin)
        agent_ok = self._agent is not None and hmac.compare_digest(presented, self._agent)
        if admin_ok:
            return True
        return agent_ok and path.startswith(FLEET_PREFIXES)

    def middleware(self, count: Callable[[str, int], None] = lambda route, code: None):
        """aiohttp middleware: 401 before the handler when the token is missing or wrong; counts every request."""

        @web.middleware
        async def authenticate(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            header = request.headers.get("Authorization")
            if not self.allowed(request.path, header):
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote,
                            "no bearer token" if not header else "wrong token",
                            extra={"event": "control-unauthorized"})
                count(route, 401)
                return web.json_response(
                    {"error": {"message": "a valid token is required: send 'Authorization: Bearer <token>' "
                                           "(llmgwctl reads it from $LLMGW_TOKEN or $LLMGW_TOKEN_FILE)",
                               "type": "authentication_error", "code": 401}},
                    status=401, headers={"WWW-Authenticate": "Bearer"})
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                count(route, exc.status)
                raise
            count(route, resp.status)
            return resp

        return authenticate
