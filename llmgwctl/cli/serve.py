"""`llmgwctl serve`: the controller, the router, the control API and this machine's agent in one process."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from .common import host_port, setup_logging


@click.command("serve")
@click.option("--catalogs", default="catalogs", show_default=True, type=click.Path(file_okay=False),
              help="The catalog directory to serve and watch.")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, callback=host_port, metavar="HOST:PORT",
              help="Where the OpenAI-compatible router listens.")
@click.option("--control", default="127.0.0.1:8081", show_default=True, callback=host_port, metavar="HOST:PORT",
              help="Where the control API listens (status, catalog apply, agents).")
@click.option("--local-agent/--no-local-agent", default=True, show_default=True,
              help="Run this machine's node agent in this process, so the bundled catalogs answer out of the box.")
@click.option("--gpus", default="auto", show_default=True, metavar="auto|none|SPEC",
              help="The local agent's GPUs: nvidia-smi, none, or simulated like 2xA100-80GB.")
@click.option("--pool", "pools", multiple=True, metavar="LABEL", help="Pool label of the local agent (repeatable).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the local agent keeps replica records and logs [default: $XDG_STATE_HOME/llmgw].")
@click.option("--node", default=None, help="The local agent's node name [default: this host's name].")
@click.option("--ports", default="20000-20999", show_default=True, metavar="LOW-HIGH",
              help="Ports the local agent gives its engines.")
@click.option("--settle", type=float, default=None, metavar="SECONDS",
              help="Settling window after start, adopting replicas before starting any [default: 15].")
@click.option("--drain-grace", type=float, default=None, metavar="SECONDS",
              help="How long a stopping replica's requests may take to finish [default: 30].")
@click.option("--node-timeout", type=float, default=None, metavar="SECONDS",
              help="A node silent this long is unreachable and its replicas leave the router [default: 15].")
@click.option("--replace-after", type=float, default=None, metavar="SECONDS",
              help="Replicas of a node unreachable this long are replaced elsewhere [default: 60].")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def command(catalogs, listen, control, local_agent, gpus, pools, state_dir, node, ports, settle, drain_grace,
            node_timeout, replace_after, verbose):
    """Serve the catalogs in DIR: place replicas, route OpenAI requests, follow every edit."""
    from ..catalog import CatalogError
    from ..control.serve import ServeConfig, serve

    setup_logging(verbose)
    cfg = ServeConfig(catalogs=catalogs, listen=listen, control=control, local_agent=local_agent, gpus=gpus,
                      pools=tuple(pools), ports=ports, settle=settle, drain_grace=drain_grace,
                      node_timeout=node_timeout, replace_after=replace_after)
    if state_dir is not None:
        cfg.state_dir = state_dir
    if node:
        cfg.node = node
    if not Path(catalogs).is_dir():
        raise click.BadParameter(f"{catalogs!r} is not a directory", param_hint="--catalogs")
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(cfg))
    except CatalogError as exc:
        for problem in exc.problems:
            click.echo(str(problem), err=True)
        click.echo(f"llmgwctl serve: {catalogs} is not a valid catalog; fix it (llmgwctl catalog validate {catalogs}) and start again",
                   err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"llmgwctl serve: {exc}", err=True)
        sys.exit(1)
