"""`llmgwctl serve`: the controller, the router, the control API and this machine's agent in one process."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from .. import aio
from .agent import allow_engine_arg_option, allow_engine_option
from .common import (
    PORT_RANGE,
    host_port,
    log_format_option,
    log_level_options,
    parsed_by,
    raise_fd_limit,
    router_options,
    setup_logging,
    tune_allocator,
)
from .output import visible

if TYPE_CHECKING:
    from ..agent.ports import PortRange
    from ..engines.custom import AllowedEngines
    from ..router.config import RouterConfig

@parsed_by
def _control_origins(values: tuple[str, ...]) -> tuple[str, ...]:
    from ..httporigin import check_origins
    # No "*": on loopback with no token, any page could then rewrite the catalog.
    return check_origins(values, "--control-cors-origin", allow_any=False)


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
@click.option("--ports", default="20000-20999", show_default=True, type=PORT_RANGE,
              help="Ports the local agent gives its engines, inclusive.")
@click.option("--max-cpu-replicas", type=click.IntRange(min=0, max=1000), default=None, metavar="N",
              help="The most replicas with no GPU (gpus: 0) placed on the local agent's node; at most the size of "
                   "--ports [default: 4 per core, less on a machine with under 256 MiB per replica].")
@click.option("--settle", type=float, default=None, metavar="SECONDS",
              help="Settling window after start, adopting replicas before starting any [default: 15].")
@click.option("--drain-grace", type=float, default=None, metavar="SECONDS",
              help="How long a stopping replica's requests may take to finish [default: 30].")
@click.option("--node-timeout", type=float, default=None, metavar="SECONDS",
              help="A node silent this long is unreachable and its replicas leave the router [default: 15].")
@click.option("--replace-after", type=float, default=None, metavar="SECONDS",
              help="Replicas of a node unreachable this long are replaced elsewhere [default: 60].")
@click.option("--token-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Bearer token every control API request must carry; required when --control is not loopback.")
@click.option("--agent-token-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="A second token that may only report, follow desired replicas, watch and wake (for agents and routers).")
@click.option("--api-keys", type=click.Path(dir_okay=False), metavar="FILE",
              help="Router API keys (YAML: name, sha256, models, rpm); followed for edits. Without it the router is open.")
@click.option("--control-connections-per-client", type=click.IntRange(min=0), default=None, metavar="N",
              help="Open control API connections one client address may hold (each agent holds two); 0: no limit "
                   "[default: 4096].")
@allow_engine_option
@click.option("--control-cors-origin", "control_cors_origins", multiple=True, metavar="ORIGIN",
              callback=_control_origins,
              help="Let browser pages from ORIGIN (https://admin.example.com) call the control API (repeatable; "
                   "no *). Default: only the console's own origin.")
@click.option("--node-revocations", type=click.Path(dir_okay=False), metavar="FILE",
              help="Node tokens refused: one 'NODE [SERIAL]' line each (tokens of NODE below SERIAL; all without one); "
                   "followed for edits.")
@click.option("--legacy-node-tokens", is_flag=True, default=False,
              help="Let node tokens from before claims (llmgwn.NODE.MAC) claim any pool, GPU count and advertise host, "
                   "while a fleet gets new tokens.")
@allow_engine_arg_option
@router_options
@log_format_option
@log_level_options
def command(catalogs: str, listen: tuple[str, int], control: tuple[str, int], local_agent: bool, gpus: str,
            pools: tuple[str, ...], state_dir: Path | None, node: str | None, ports: PortRange,
            max_cpu_replicas: int | None, settle: float | None, drain_grace: float | None, node_timeout: float | None,
            replace_after: float | None, token_file: str | None, agent_token_file: str | None, api_keys: str | None,
            control_connections_per_client: int | None, allow_engines: AllowedEngines,
            control_cors_origins: tuple[str, ...], node_revocations: str | None, legacy_node_tokens: bool,
            allow_engine_args: tuple[str, ...], log_format: str, log_level: str | None, verbose: int,
            router_config: RouterConfig) -> None:

    """Serve the catalogs in DIR: place replicas, route OpenAI requests, follow every edit."""
    from ..catalog import CatalogError
    from ..control.auth import TokenError, check_bind, read_token_file
    from ..control.errors import ControlError
    from ..control.serve import ServeConfig, serve
    from ..router.auth import KeyFileError

    for given, flag in ((allow_engines, "--allow-engine"), (allow_engine_args, "--allow-engine-arg")):
        if given and not local_agent:
            raise click.UsageError(f"{flag} is for the local agent; with --no-local-agent give it to each "
                                   "node's llmgwctl agent")
    if max_cpu_replicas is not None and not local_agent:
        raise click.UsageError("--max-cpu-replicas is the local agent's: it does nothing with --no-local-agent "
                               "(give it to each `llmgwctl agent` instead)")
    if (node_revocations or legacy_node_tokens) and not agent_token_file:
        raise click.UsageError("--node-revocations and --legacy-node-tokens are about node tokens, which need "
                               "--agent-token-file (the secret they are signed with)")
    if agent_token_file and not token_file:
        raise click.UsageError("--agent-token-file needs --token-file: without an admin token every other route would be open")
    try:
        token = read_token_file(token_file) if token_file else None
        agent_token = read_token_file(agent_token_file, "--agent-token-file") if agent_token_file else None
        check_bind(control[0], token)
    except TokenError as exc:
        raise click.UsageError(str(exc)) from None
    setup_logging(verbose, log_format, level=log_level)
    cfg = ServeConfig(catalogs=catalogs, listen=listen, control=control, local_agent=local_agent, gpus=gpus,
                      pools=tuple(pools), ports=str(ports), max_cpu_replicas=max_cpu_replicas, settle=settle, drain_grace=drain_grace,
                      node_timeout=node_timeout, replace_after=replace_after, token=token, agent_token=agent_token,
                      api_keys=api_keys, router=router_config, allow_engines=allow_engines.with_args(allow_engine_args),
                      control_cors_origins=tuple(control_cors_origins), legacy_node_tokens=legacy_node_tokens,
                      node_revocations=node_revocations)
    if state_dir is not None:
        cfg.state_dir = state_dir
    if control_connections_per_client is not None:
        cfg.control_connections_per_client = control_connections_per_client
    if node:
        cfg.node = node
    if local_agent and agent_token:
        from ..control.auth import check_node_name
        try:
            check_node_name(cfg.node)     # the local agent's node token names it
        except TokenError as exc:
            raise click.BadParameter(str(exc), param_hint="--node") from None
    if not Path(catalogs).is_dir():
        raise click.BadParameter(f"{catalogs!r} is not a directory", param_hint="--catalogs")
    raise_fd_limit()
    tune_allocator()
    try:
        aio.run(serve(cfg))
    except CatalogError as exc:
        # One problem a line, each printable as it is (a file name or value may hold an escape).
        problems = "\n".join(visible(p) for p in exc.problems)
        raise click.ClickException(f"{problems}\n{visible(catalogs)} is not a valid catalog; fix it "
                                   f"(llmgwctl catalog validate {visible(catalogs)}) and start again") from None
    except KeyFileError as exc:
        raise click.ClickException(visible(f"{exc}\n{api_keys} is not a valid API key file; fix it and start again",
                                           keep="\n")) from None
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:      # the state directory or a log file cannot be created, and the like
        raise click.ClickException(str(exc)) from None
