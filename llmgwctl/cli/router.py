"""`llmgwctl router`: the OpenAI-compatible router as its own process."""
from __future__ import annotations

import click

from .common import host_port, log_format_option, setup_logging


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
@click.option("--poll-interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between reads of each engine's /metrics.")
@click.option("--cold-timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="Seconds a request waits for a cold model's first replica before 503.")
@click.option("--cold-queue", type=click.IntRange(min=0), default=256, show_default=True,
              help="Requests that may wait per cold model; more get 429.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=32 * 1024 * 1024, show_default=True,
              help="Larger request bodies get 413.")
@click.option("--api-keys", type=click.Path(dir_okay=False), metavar="FILE",
              help="Require API keys (YAML: name, sha256, models, rpm); followed for edits. Without it the router is open.")
@click.option("--max-connections-per-client", type=click.IntRange(min=0), default=256, show_default=True,
              help="Open connections one client address may hold; 0 for no limit (behind a load balancer).")
@click.option("--upstream-idle-timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds a stream's engine may send nothing before the stream ends (504, or an error event); 0: never.")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="One line per request on the llmgw.access log (at info level).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@log_format_option
def command(listen: tuple[str, int], controller: str | None, endpoints_file: str | None, catalogs_dir: str | None,
            token: str | None, token_file, poll_interval: float, cold_timeout: float, cold_queue: int, max_body_bytes: int,
            api_keys: str | None, max_connections_per_client: int, upstream_idle_timeout: float, access_log: bool, log_level: str,
            log_format: str) -> None:
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
    setup_logging(0, log_format, level=log_level)

    from ..catalog import CatalogError
    from ..router import RouterConfig
    from ..router.auth import KeyFileError
    from ..router.standalone import run
    from ..router.static import EndpointFileError

    config = RouterConfig(poll_interval=poll_interval, cold_timeout=cold_timeout, cold_queue=cold_queue,
                          max_body_bytes=max_body_bytes, max_connections_per_client=max_connections_per_client,
                          upstream_idle_timeout=upstream_idle_timeout,
                          access_log=access_log)
    _raise_fd_limit()
    host, port = listen

    def announce(bound: int) -> None:
        # One line a parent process can read to learn the port when it asked for 0.
        click.echo(f"router listening on http://{host}:{bound}")

    coro = run(host, port, endpoints_file=endpoints_file, catalogs_dir=catalogs_dir, controller=controller,
               token=token, config=config, on_listening=announce, api_keys=api_keys)
    try:
        _run_loop(coro)
    except (CatalogError, EndpointFileError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _run_loop(coro) -> None:
    try:
        import uvloop
    except ImportError:     # the `fast` extra is optional; asyncio's loop works, slower
        import asyncio
        asyncio.run(coro)
        return
    uvloop.run(coro)


def _raise_fd_limit() -> None:
    # Every proxied request holds two sockets (client and engine); the usual
    # soft limit of 1024 would cap the router near 500 concurrent streams.
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
