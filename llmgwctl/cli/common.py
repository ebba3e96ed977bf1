"""Bits several commands share: HOST:PORT options, the controller URL, logging setup."""
from __future__ import annotations

import os

import click

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


def setup_logging(verbose: int, log_format: str = "text", level: str | None = None) -> None:
    """Human-readable lines by default; `log_format="json"` for collectors (see llmgwctl.observability.logs)."""
    from ..observability.logs import setup_logging as setup
    setup(verbose, log_format, level=level)


log_format_option = click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
    help="text for people, json (one object per line) for log collectors.")


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
