"""`llmgwctl router`: the OpenAI-compatible router as its own process."""
from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import click

from .. import aio
from .common import (
    host_port,
    log_format_option,
    log_level_options,
    raise_fd_limit,
    router_options,
    setup_logging,
    tune_allocator,
)

if TYPE_CHECKING:
    from ..router.config import RouterConfig


@click.command("router")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, callback=host_port,
              help="Address for the OpenAI-compatible API; port 0 picks a free one (printed on stdout).")
@click.option("--controller", metavar="URL", help="Follow this controller's endpoint and catalog watch stream.")
@click.option("--endpoints", "endpoints_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="A static endpoint list (YAML), for a router with no control plane. Needs --catalogs.")
@click.option("--catalogs", "catalogs_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="The catalog directory the static endpoints' models are in; followed for edits.")
@click.option("--token", envvar="LLMGW_TOKEN", help="Bearer token for the controller's API. [env: LLMGW_TOKEN]")
@click.option("--token-file", type=click.File("r"), metavar="FILE",
              help="Read the controller's bearer token from FILE (keeps it out of the process list).")
@click.option("--api-keys", type=click.Path(dir_okay=False), metavar="FILE",
              help="Require API keys (YAML: name, sha256, models, rpm); followed for edits. Without it the router is open.")
@log_level_options
@log_format_option
@router_options
def command(listen: tuple[str, int], controller: str | None, endpoints_file: str | None, catalogs_dir: str | None,
            token: str | None, token_file: TextIO | None, api_keys: str | None, log_level: str | None, verbose: int,
            log_format: str, router_config: RouterConfig) -> None:

    """Serve the OpenAI-compatible API, routing each request to a ready, lightly loaded replica."""
    if controller and (endpoints_file or catalogs_dir):
        raise click.UsageError("use either --controller or --endpoints with --catalogs, not both")
    if not controller and not (endpoints_file and catalogs_dir):
        raise click.UsageError("give --controller URL, or both --endpoints FILE and --catalogs DIR")
    if token_file is not None:
        if token:
            raise click.UsageError("use either --token (or $LLMGW_TOKEN) or --token-file, not both")
        token = token_file.read().strip()
        if not token:
            raise click.BadParameter(f"{token_file.name} is empty", param_hint="--token-file")
    setup_logging(verbose, log_format, level=log_level)

    from ..catalog import CatalogError
    from ..router.auth import KeyFileError
    from ..router.standalone import run
    from ..router.static import EndpointFileError

    raise_fd_limit()
    tune_allocator()
    host, port = listen

    def announce(bound: int) -> None:
        # One line a parent process can read to learn the port when it asked for 0.
        from ..observability.logs import stdout_line
        url = f"http://{host}:{bound}"
        click.echo(stdout_line(f"router listening on {url}", log_format, logger="llmgw.router",
                               event="listening", url=url))

    coro = run(host, port, endpoints_file=endpoints_file, catalogs_dir=catalogs_dir, controller=controller,
               token=token, config=router_config, on_listening=announce, api_keys=api_keys)
    try:
        aio.run(coro)
    except (CatalogError, EndpointFileError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None

