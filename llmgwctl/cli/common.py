"""Bits several commands share: HOST:PORT options, the controller URL, logging setup, the router's knobs."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    import requests

    from ..agent.ports import PortRange as Range

    # click is generic in the value a type converts to from 8.3 on; setup.cfg
    # allows 8.1, where ParamType cannot be subscripted, so only the checker sees it.
    _PortRangeParam = click.ParamType[Range]
else:
    _PortRangeParam = click.ParamType

_In = TypeVar("_In")
_Out = TypeVar("_Out")
F = TypeVar("F", bound=Callable[..., Any])
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

# Where `status` and `catalog apply` find the controller: $LLMGW_CONTROLLER, else
# the control API's default address on this machine.
DEFAULT_CONTROLLER = "http://127.0.0.1:8081"

controller_option = click.option(
    "--controller", metavar="URL", default=lambda: os.environ.get("LLMGW_CONTROLLER", DEFAULT_CONTROLLER),
    show_default="$LLMGW_CONTROLLER or http://127.0.0.1:8081", help="The control API to talk to.")


def host_port(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    """A HOST:PORT option; the host is required, since which address is opened is the point of asking."""
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"expected HOST:PORT such as 127.0.0.1:8080, got {value!r}")
    return host.strip("[]"), int(port)


def parsed_by(parse: Callable[[_In], _Out]) -> Callable[[click.Context, click.Parameter, _In], _Out]:
    """A click callback passing an option's value through `parse`, whose ValueError is that option's usage error.

    So every option refuses a bad value alike: exit 2, the option named,
    `parse`'s own message (which says what was wrong) after it.
    """
    def callback(ctx: click.Context, param: click.Parameter, value: _In) -> _Out:
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return callback


def setup_logging(verbose: int, log_format: str = "text", level: str | None = None) -> None:
    """Human-readable lines by default; `log_format="json"` for collectors (see llmgwctl.observability.logs)."""
    from ..observability.logs import setup_logging as setup
    setup(verbose, log_format, level=level)


log_format_option = click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
    help="text for people, json (one object per line) for log collectors.")


def log_level_options(command: F) -> F:
    """`--log-level LEVEL`, every long-running command's one logging flag, and `-v` kept as a hidden alias.

    `--log-level` because it is what uvicorn, vLLM's server and most daemons
    take, and it says what it does; `-v` (`-vv` debug), which `serve` and
    `agent` took before, still works so no unit file breaks. The command gets
    `log_level` (None: not given, info) and `verbose` (a count).
    """
    command = click.option("-v", "--verbose", count=True, hidden=True,
                           help="Deprecated alias: -v is info with aiohttp's access log, -vv is --log-level debug.")(command)
    return click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
                        show_default="info", help="Log this level and above.")(command)


class PortRange(_PortRangeParam):
    """`--ports LOW-HIGH`, inclusive, the one port-range syntax of `serve` and `agent` (as iptables' and nmap's)."""

    name = "LOW-HIGH"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> Range:
        from ..agent.errors import PortRangeError
        from ..agent.ports import PortRange as Range
        if isinstance(value, Range):
            return value
        if not isinstance(value, str):
            self.fail(f"expected LOW-HIGH, got {value!r}", param, ctx)
        try:
            return Range.parse(value)
        except PortRangeError as exc:
            self.fail(str(exc), param, ctx)


PORT_RANGE = PortRange()


def controller_headers() -> dict[str, str]:
    """The bearer token for the control API, from $LLMGW_TOKEN or the file named by $LLMGW_TOKEN_FILE."""
    token = os.environ.get("LLMGW_TOKEN")
    path = os.environ.get("LLMGW_TOKEN_FILE")
    if not token and path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise click.ClickException(f"LLMGW_TOKEN_FILE={path}: cannot read: {exc.strerror or exc}") from None
    return {"Authorization": f"Bearer {token}"} if token else {}


def unreachable(controller: str, exc: Exception) -> click.ClickException:
    """The error of a call that got no answer from the controller: what to check, the exception's name only."""
    return click.ClickException(f"cannot reach the controller at {controller}: {exc.__class__.__name__}; "
                                "is `llmgwctl serve` running? (--controller or $LLMGW_CONTROLLER)")


def refused(resp: requests.Response) -> click.ClickException:
    """The error of an answer that is not what was asked for: the control API's own message, else its text's start."""
    from .output import visible

    try:
        message = resp.json()["error"]["message"]   # a missing or odd field: the except below
    except (ValueError, KeyError, TypeError):
        message = resp.text[:300]
    return click.ClickException(visible(f"{message} (HTTP {resp.status_code})"))


# The data plane's knobs, the same on `llmgwctl router` and on the router inside
# `llmgwctl serve`: an operator tuning one expects the other to take the same flags.
# Each default is RouterConfig's, where its reason is given.
_ROUTER_FIELDS = ("poll_interval", "probe_timeout", "eject_after", "max_attempts", "cold_timeout", "cold_queue", "max_body_bytes", "max_connections_per_client",
                  "upstream_idle_timeout", "upstream_headers_timeout", "max_answer_bytes", "max_metrics_bytes",
                  "access_log", "cold_keepalive", "cors_origins", "allowed_hosts")


def _router_options() -> tuple[Decorator, ...]:

    # Imported here, when `router` or `serve` is being built, not when any
    # command imports this module: `catalog validate` does not load the router.
    from ..router.config import DEFAULTS as d

    return (
        click.option("--poll-interval", type=click.FloatRange(min=0.05), default=d.poll_interval, show_default=True,
                     help="Seconds between reads of each engine's /metrics."),
        click.option("--probe-timeout", type=click.FloatRange(min=0.05), default=d.probe_timeout, show_default=True,
                     metavar="SECONDS",
                     help="A read of an engine's /metrics (the router's health probe) taking longer is a miss."),
        click.option("--eject-after", type=click.IntRange(min=0), default=d.eject_after, show_default=True,
                     metavar="N",
                     help="Misses in a row that take a replica out of routing until it answers again; 0: never."),
        click.option("--max-attempts", type=click.IntRange(min=1), default=d.max_attempts, show_default=True,
                     metavar="N",
                     help="Replicas a request is tried on when one fails before any byte of its answer (refused, "
                          "reset, headers cut or late, 502/503); 1: no retries."),
        click.option("--cold-timeout", type=click.FloatRange(min=0), default=d.cold_timeout, show_default=True,
                     help="Seconds a request waits for a cold model's first replica before 503."),
        click.option("--cold-queue", type=click.IntRange(min=0), default=d.cold_queue, show_default=True,
                     help="Requests that may wait per cold model; more get 429."),
        click.option("--max-body-bytes", type=click.IntRange(min=1), default=d.max_body_bytes, show_default=True,
                     help="Larger request bodies get 413."),
        click.option("--max-connections-per-client", type=click.IntRange(min=0), default=d.max_connections_per_client,
                     show_default=True,
                     help="Open connections one client address may hold; 0 for no limit (behind a load balancer)."),
        click.option("--upstream-idle-timeout", type=click.FloatRange(min=0), default=d.upstream_idle_timeout,
                     show_default=True,
                     help="Seconds a stream's engine may send nothing before the stream ends (504, or an error "
                          "event); 0: never."),
        click.option("--upstream-headers-timeout", type=click.FloatRange(min=0), default=d.upstream_headers_timeout,
                     show_default=True,
                     help="Seconds an engine may take to send an answer's headers, for every request (504); a "
                          "whole answer's come when it is done. 0: never."),
        click.option("--max-answer-bytes", type=click.IntRange(min=1), default=d.max_answer_bytes, show_default=True,
                     help="Larger whole (non-stream) engine answers get 502 and the replica is ejected for a while."),
        click.option("--max-metrics-bytes", type=click.IntRange(min=1), default=d.max_metrics_bytes,
                     show_default=True, help="Larger engine /metrics pages are not read (no load reading)."),
        click.option("--access-log/--no-access-log", default=d.access_log, show_default=True,
                     help="One line per router request on the llmgw.access log (at info level)."),
        click.option("--cold-keepalive", type=click.FloatRange(min=0), default=d.cold_keepalive, show_default=True,
                     metavar="SECONDS",
                     help="A stream waiting for a cold start gets an SSE comment this often; 0: none."),
        click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
                     callback=_origins,
                     help="Let browser pages from ORIGIN (https://app.example.com, or *) call the API "
                          "(repeatable). Default: no CORS, and pages of other origins get 403."),
        click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME", callback=_host_names,
                     help="A Host name to answer to besides IP addresses, dotless names and localhost "
                          "(repeatable; *.example.com for a domain, * for any). Others get 403 (DNS rebinding)."),
    )


@parsed_by
def _origins(values: tuple[str, ...]) -> tuple[str, ...]:
    from ..httporigin import check_origins
    return check_origins(values, "--cors-origin")


@parsed_by
def _host_names(values: tuple[str, ...]) -> tuple[str, ...]:
    from ..httporigin import check_names
    return check_names(values, "--allowed-host")


def router_options(command: Callable[..., None]) -> Callable[..., None]:
    """Add the router's options to `command`, which receives them as one `router_config` (a RouterConfig)."""
    from ..router.config import RouterConfig

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:

        values = {name: kwargs.pop(name) for name in _ROUTER_FIELDS}
        values["cors_origins"] = tuple(values["cors_origins"])
        values["allowed_hosts"] = tuple(values["allowed_hosts"])
        return command(*args, router_config=RouterConfig(**values), **kwargs)
    decorated: Callable[..., None] = wrapper
    for option in reversed(_router_options()):
        decorated = option(decorated)
    return decorated



def raise_fd_limit() -> None:
    """Lift the soft open-file limit to the hard one, for processes that proxy.

    Every proxied request holds two sockets (client and engine); the usual soft
    limit of 1024 would cap a router near 500 concurrent streams.
    """
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def tune_allocator() -> None:
    """Fix glibc's mmap threshold, for processes that hold large bodies (see llmgwctl.allocator); off glibc, nothing."""
    from .. import allocator
    allocator.tune()
