"""Which web pages may use an llmgw server: the Host, Origin and Sec-Fetch-Site checks both ports share.

A web page in the operator's browser is not the operator. Left open, any
page could make that browser send the control API on 127.0.0.1 a catalog (a
CORS "simple request" -- `fetch(url, {mode: "no-cors", body, headers:
{"Content-Type": "text/plain"}})` -- is sent without asking and acted on,
though the page never reads the answer), spend GPU time through the router
the same way, or, by DNS rebinding (a name of the attacker's that resolves to
127.0.0.1 once the page has loaded), read status as a same-origin page. So
`BrowserGuard`, an aiohttp middleware, answers 403 before any handler runs to:

- a `Host` that is not a name this server answers to, when the check is on
  (`check_host`): an IP literal, a name without a dot, `localhost` and
  `*.localhost` always pass, and the names given with `--allowed-host`.
  Rebinding needs a name the attacker can point at this address: a public
  DNS name, which has a dot. An IP literal in Host means the browser dialled
  that very address, and a dotless name (this machine's short host name, a
  container's) resolves only through the local resolver, never the attacker's.
- an `Origin` that is neither this server's own (the scheme, host and port
  the request's Host names, once Host passed) nor one `--cors-origin` allows;
- a request without an Origin whose `Sec-Fetch-Site` is `cross-site` or
  `same-site` (a no-cors GET from another page, an `<img>`), unless it is a
  person following a link to a page (`Sec-Fetch-Mode: navigate`, GET).

A CORS preflight from an allowed origin is answered here (204 with the
Access-Control-Allow-* headers), and answers to that origin name it
(`Access-Control-Allow-Origin`); no other origin gets either.

Clients that are not browsers -- the CLI, agents, standalone routers, curl,
the OpenAI SDKs -- send no Origin and no Sec-Fetch-*, and a Host naming the
address they dialled, so they pass as they always did. Browsers set Origin,
Host and Sec-Fetch-* themselves; no page script can forge or remove them.

It must not know about routes: it sees the method and a few header lines.
"""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .httpserver import error_body

log = logging.getLogger("llmgw.httporigin")

# Browsers cache a preflight this long (Starlette's default, 10 minutes).
PREFLIGHT_MAX_AGE = "600"
# Host values whose verdict is remembered: a server is reached by a handful of
# names; the bound keeps a stranger's stream of invented names from growing it.
HOST_VERDICTS = 1024
# How much of a client's header an error quotes: enough to recognise, never a page of it.
QUOTE = 100

_SAFE = frozenset(("GET", "HEAD"))
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Origins:
    """The origins `--cors-origin` names ("*": any); an origin compares without a trailing slash."""

    __slots__ = ("any", "named")

    def __init__(self, origins: Iterable[str] = ()):
        names = frozenset(o.strip().rstrip("/") for o in origins)
        self.any = "*" in names
        self.named = names - {"*"}

    def __bool__(self) -> bool:
        return self.any or bool(self.named)

    def allows(self, origin: str) -> bool:
        return self.any or origin.rstrip("/") in self.named


def split_host(value: str) -> tuple[str, int | None] | None:
    """(host lowercased without a trailing dot, port or None) from a Host header; None when it is malformed."""
    value = value.strip()
    port_text = ""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if rest:
            if not rest.startswith(":"):
                return None
            port_text = rest[1:]
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    else:
        host = value        # no port; more than one colon is an unbracketed IPv6 literal, checked as one
    port = None
    if port_text:
        if not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5:
            return None
        port = int(port_text)
    host = host.lower().rstrip(".")
    return (host, port) if host else None


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def always_allowed(host: str) -> bool:
    """A Host no DNS rebinding can produce: an IP literal, a name without a dot, localhost (see the module doc)."""
    return "." not in host or host.endswith(".localhost") or is_ip(host)


class AllowedHosts:
    """The names `--allowed-host` adds: exact names, `*.suffix` for every name under a domain, `*` for any."""

    __slots__ = ("any", "names", "suffixes")

    def __init__(self, names: Iterable[str] = ()):
        cleaned = {n.strip().lower().rstrip(".") for n in names}
        self.any = "*" in cleaned
        self.suffixes = tuple(n[1:] for n in cleaned if n.startswith("*.") and len(n) > 2)
        self.names = frozenset(n for n in cleaned if n and not n.startswith("*"))

    def allows(self, host: str) -> bool:
        return self.any or host in self.names or any(host.endswith(s) for s in self.suffixes)


def check_names(values: Iterable[str], option: str) -> tuple[str, ...]:
    """The `--allowed-host` values, each a host name (no scheme, port or path); ValueError naming the bad one."""
    out = []
    for value in values:
        name = value.strip()
        bare = name[2:] if name.startswith("*.") else name
        if name != "*" and (not bare or any(c in bare for c in "/:@ *?#[]") or not bare.isprintable()):
            raise ValueError(f"{option} {value!r}: give a host name as the Host header carries it, without "
                             "scheme or port (llm.example.com, *.example.com, or * for any)")
        out.append(name)
    return tuple(out)


def check_origins(values: Iterable[str], option: str, *, allow_any: bool = True) -> tuple[str, ...]:
    """The `--cors-origin` values, each scheme://host[:port] (or "*" when `allow_any`); ValueError naming the bad one."""
    out = []
    for value in values:
        origin = value.strip().rstrip("/")
        if origin == "*":
            if not allow_any:
                raise ValueError(f"{option} '*' would let every web page use it; name each origin "
                                 "(https://admin.example.com)")
            out.append(origin)
            continue
        parts = urlsplit(origin)
        if (_origin_parts(origin) is None or parts.path or parts.query or parts.fragment or "@" in parts.netloc):
            raise ValueError(f"{option} {value!r}: an origin is scheme://host[:port], as a browser sends it "
                             "(https://app.example.com, http://localhost:3000)")
        out.append(origin)
    return tuple(out)


def _origin_parts(origin: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    default = _DEFAULT_PORTS.get(parts.scheme)
    if default is None or not parts.hostname:
        return None
    return parts.hostname.rstrip("."), port if port is not None else default


def same_origin(origin: str, host_header: str | None) -> bool:
    """Whether `origin` is the server's own: the host and port the request's Host names.

    A Host without a port is the origin's scheme's default port (a TLS proxy
    in front forwarding `Host: llm.example.com` for https://llm.example.com).
    """
    if host_header is None:
        return False
    theirs, ours = _origin_parts(origin), split_host(host_header)
    if theirs is None or ours is None:
        return False
    return theirs[0] == ours[0] and theirs[1] == (ours[1] if ours[1] is not None else theirs[1])


if TYPE_CHECKING:
    # aiohttp loads when a middleware is made: the checks above need no HTTP stack.
    from aiohttp import web
    from aiohttp.typedefs import Middleware

    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BrowserGuard:
    """The checks of the module doc for one server, with its options' names for the messages.

    `check_host`: whether Host is checked at all. Servers bound to loopback
    always check it (nothing but this machine reaches them, by 127.0.0.1 or
    localhost); beyond loopback a server is reached by names llmgw cannot know
    (DNS aliases, load balancers, Kubernetes services), so Host is checked
    there once the operator names them with `--allowed-host` (see `for_bind`).
    """

    def __init__(self, *, server: str, cors_origins: Iterable[str] = (), allowed_hosts: Iterable[str] = (),
                 check_host: bool = True, expose: str = "X-Request-Id, Retry-After",
                 methods: str = "GET, POST, OPTIONS",
                 cors_option: str = "--cors-origin", host_option: str = "--allowed-host"):
        self.server = server
        # What a preflight allows: the methods the server's routes take (the
        # router's DELETE /v1/responses/{id} among them), so a browser client
        # of an allowed origin can call every route it could call without CORS.
        self.methods = methods
        self.cors = Origins(cors_origins)
        self.hosts = AllowedHosts(allowed_hosts)
        self.check_host = check_host
        self.expose = expose
        self.cors_option = cors_option
        self.host_option = host_option
        self._verdicts: dict[str, bool] = {}

    @classmethod
    def for_bind(cls, bind_host: str | None, *, allowed_hosts: Iterable[str] = (), **kwargs: Any) -> BrowserGuard:
        """The guard for a server bound to `bind_host` (None: loopback, as tests bind)."""
        allowed_hosts = tuple(allowed_hosts)
        loopback = bind_host is None or _is_loopback(bind_host)
        names = allowed_hosts
        if bind_host and not loopback and not is_ip(bind_host.strip("[]")):
            names = (*names, bind_host)     # bound to a name: that name is one it answers to
        return cls(allowed_hosts=names, check_host=loopback or bool(allowed_hosts), **kwargs)

    def install(self, app: web.Application) -> None:
        """Answer allowed origins' CORS on `app` (an aiohttp Application whose middlewares hold `middleware`)."""
        if self.cors:
            app.on_response_prepare.append(self._name_origin)

    # -- the checks --------------------------------------------------------------------

    def host_allowed(self, value: str) -> bool:
        verdict = self._verdicts.get(value)
        if verdict is None:
            parts = split_host(value)
            verdict = parts is not None and (always_allowed(parts[0]) or self.hosts.allows(parts[0]))
            if len(self._verdicts) >= HOST_VERDICTS:
                self._verdicts.clear()
            self._verdicts[value] = verdict
        return verdict

    def refusal(self, method: str, headers: Mapping[str, str]) -> tuple[str, str] | None:
        """(code, message) when the request must be refused; None when it may go on."""
        host = headers.get("Host")
        if host is not None and self.check_host and not self.host_allowed(host):
            shown = host[:QUOTE]
            name = split_host(host)
            return "host_not_allowed", (
                f"the Host header {shown!r} is not a name this {self.server} answers to: a page of another site "
                "can point a name of its own at this address (DNS rebinding). Reach it by IP address or "
                f"localhost, or start it with {self.host_option} {name[0] if name else 'NAME'} to answer to that name")
        origin = headers.get("Origin")
        if origin is not None:
            if self.cors.allows(origin) or same_origin(origin, host):
                return None
            return "cors_origin_not_allowed", (
                f"requests from web pages of {origin[:QUOTE]!r} are refused: a page of another site may not "
                f"use this {self.server}. To let pages of that origin call it, start it with "
                f"{self.cors_option} {origin[:QUOTE]}")
        site = headers.get("Sec-Fetch-Site")
        if site is not None and not self.cors.any:
            site = site.strip().lower()
            if site in ("cross-site", "same-site") and not (
                    method in _SAFE and headers.get("Sec-Fetch-Mode", "").strip().lower() == "navigate"):
                return "cross_site_request", (
                    f"a {site} request from a web page is refused (Sec-Fetch-Site: {site}): a page of another "
                    f"site may not use this {self.server}. A page allowed with {self.cors_option} must call it "
                    "with CORS (fetch's default mode), not no-cors")
        return None

    def middleware(self) -> Middleware:

        """The aiohttp middleware: 403 before any handler for what the checks refuse; preflights answered."""
        from aiohttp import web

        refusal, preflight, cors = self.refusal, self._preflight, bool(self.cors)

        @web.middleware
        async def browsers(request: web.Request, handler: Handler) -> web.StreamResponse:
            wrong = refusal(request.method, request.headers)
            if wrong is not None:
                code, message = wrong
                log.info("refused %s %s from %s: %s", request.method, request.path, request.remote, code,
                         extra={"event": "browser-refused", "code": code})
                return web.Response(status=403, body=error_body(message, "permission_error", code),
                                    content_type="application/json")
            if cors and request.method == "OPTIONS":
                return preflight(request)
            return await handler(request)

        return browsers

    # -- CORS, for the allowed origins only -----------------------------------------------

    def _preflight(self, request: web.Request) -> web.Response:
        from aiohttp import web

        origin = request.headers.get("Origin")
        if origin is None or request.headers.get("Access-Control-Request-Method") is None \
                or not self.cors.allows(origin):
            # Not a preflight (or one from our own origin, which browsers never send):
            # a plain OPTIONS, answered with what the server takes.
            return web.Response(status=204, headers={"Allow": "HEAD, " + self.methods})
        headers = {"Access-Control-Allow-Origin": "*" if self.cors.any else origin,
                   "Access-Control-Allow-Methods": self.methods,
                   "Access-Control-Max-Age": PREFLIGHT_MAX_AGE}
        if not self.cors.any:
            headers["Vary"] = "Origin"
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            # Echoed, as Starlette does with allow_headers=["*"]: browser SDKs
            # send headers of their own (OpenAI's x-stainless-*), and the
            # bearer token is checked whatever the preflight said.
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)

    async def _name_origin(self, request: web.Request, response: web.StreamResponse) -> None:

        origin = request.headers.get("Origin")
        if origin is None or not self.cors.allows(origin) or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if self.cors.any else origin
        response.headers["Access-Control-Expose-Headers"] = self.expose
        if not self.cors.any:
            response.headers.add("Vary", "Origin")


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
