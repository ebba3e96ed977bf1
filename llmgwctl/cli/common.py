"""Bits several commands share: HOST:PORT options, the controller URL, logging setup."""
from __future__ import annotations

import logging
import os

import click

# Where `status` and `catalog apply` find the controller: $LLMGW_CONTROLLER, else
# the control API's default address on this machine.
DEFAULT_CONTROLLER = "http://127.0.0.1:8081"

controller_option = click.option(
    "--controller", metavar="URL", default=lambda: os.environ.get("LLMGW_CONTROLLER", DEFAULT_CONTROLLER),
    show_default="$LLMGW_CONTROLLER or http://127.0.0.1:8081", help="The control API to talk to.")


def host_port(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"expected HOST:PORT such as 127.0.0.1:8080, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def setup_logging(verbose: int) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    if verbose < 2:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
