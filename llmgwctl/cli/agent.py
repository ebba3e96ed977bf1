"""`llmgwctl agent`: run this machine's node agent."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import click

from ..agent.controller import HEARTBEAT
from ..agent.core import START_TIMEOUT, STOP_GRACE
from ..agent.health import PROBE_TIMEOUT, RESTART_UNHEALTHY_AFTER, UNHEALTHY_AFTER, HealthPolicy
from .common import PORT_RANGE, log_format_option, log_level_options, parsed_by, setup_logging

if TYPE_CHECKING:
    from ..agent.ports import PortRange
    from ..engines.custom import AllowedEngines


@parsed_by
def _gpus(value: str) -> str:
    """auto, none, or a SPEC that parses; kept as written, for the agent to read when it starts."""
    from ..agent.gpus import parse_spec
    if value not in ("auto", "none"):
        parse_spec(value)
    return value


@parsed_by
def _allow_engines(values: tuple[str, ...]) -> AllowedEngines:
    from ..engines.custom import AllowedEngines
    return AllowedEngines.parse(values)


# Nothing by default: whoever writes the catalog decides which models run, the
# node's operator decides which programs run on the node (llmgwctl-agent(1)).
allow_engine_option = click.option(
    "--allow-engine", "allow_engines", multiple=True, metavar="NAME=PROGRAM", callback=_allow_engines,
    help="Run the catalog-defined engine NAME here, executing only PROGRAM (an absolute path or a name on PATH); "
         "repeatable. Without it no catalog-defined engine runs on this node.")


@parsed_by
def _allow_engine_args(values: tuple[str, ...]) -> tuple[str, ...]:
    from ..engines.codeargs import normalize_option
    return tuple(normalize_option(v) for v in values)


# Nothing by default: an option such as --trust-remote-code makes the engine
# run code the catalog's writers choose, and what runs on a node is its
# operator's choice (llmgwctl-agent(1) lists them and why).
allow_engine_arg_option = click.option(
    "--allow-engine-arg", "allow_engine_args", multiple=True, metavar="OPTION", callback=_allow_engine_args,
    help="Let profiles pass the engine option OPTION, one that makes an engine run code (such as "
         "--trust-remote-code); repeatable. Without it a replica passing one is refused.")


# Defaults and why: the node name is the host name because it is what an
# operator sees in `ssh` and the GPU dashboards, and it survives restarts; the
# port range 20000-20999 sits below Linux's ephemeral range (32768+), so
# outgoing connections never take an engine's port, and leaves room for 1000
# replicas; engines bind to loopback unless the operator opens them up,
# because an engine has no authentication of its own.
@click.command("agent")
@click.option("--controller", metavar="URL", help="The controller to report to and take desired replicas from.")
@click.option("--node", default=socket.gethostname, show_default="this host's name",
              help="This node's name in the fleet; stable across restarts.")
@click.option("--gpus", default="auto", show_default=True, callback=_gpus,
              help="auto (nvidia-smi), none (CPU-only), or a simulated SPEC like 4xH100-80GB or 2xA100-80GB,1xL4-24GB.")
@click.option("--pool", "pools", multiple=True, metavar="LABEL",
              help="A pool label placement may target (repeatable).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where replicas.json and the engines' logs live; keep it across agent restarts.")
@click.option("--advertise-host", default="127.0.0.1", show_default=True,
              help="Address engines bind to and the router reaches them at.")
@click.option("--ports", default="20000-20999", show_default=True, type=PORT_RANGE,
              help="Port range engines listen on, inclusive.")
@click.option("--desired", "desired_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Follow a YAML/JSON file {replicas: [...]} instead of the controller's desired list.")
@click.option("--token-file", type=click.File("r"),
              help="This node's token for the controller (llmgwctl token node NAME), read from this file.")
@click.option("--grace", type=click.FloatRange(min=0), default=STOP_GRACE, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping an engine.")
@click.option("--start-timeout", type=click.FloatRange(min=1), default=START_TIMEOUT, show_default=True,
              help="Seconds an engine may take to pass its health check before it is restarted.")
@click.option("--probe-timeout", type=click.FloatRange(min=0.05), default=PROBE_TIMEOUT, show_default=True,
              metavar="SECONDS", help="Seconds an engine's health check may take; longer counts as failed.")
@click.option("--unhealthy-after", type=click.IntRange(min=0), default=UNHEALTHY_AFTER, show_default=True,
              metavar="N",
              help="Failed health checks in a row that make a ready engine reported not ready; 0: never.")
@click.option("--restart-unhealthy-after", type=click.FloatRange(min=0), default=RESTART_UNHEALTHY_AFTER,
              show_default=True, metavar="SECONDS",
              help="Seconds an unhealthy engine may take to pass again before it is restarted; 0: never.")
@click.option("--heartbeat", type=click.FloatRange(min=0.1), default=HEARTBEAT, show_default=True,
              help="Seconds between reports to the controller when nothing changes.")
@allow_engine_option
@click.option("--max-cpu-replicas", type=click.IntRange(min=0, max=1000), default=None, metavar="N",
              help="The most replicas with no GPU (gpus: 0) placed on this node; at most the size of --ports "
                   "[default: 4 per core, less on a machine with under 256 MiB per replica].")
@allow_engine_arg_option
@log_level_options
@log_format_option
def command(controller: str | None, node: str, gpus: str, pools: tuple[str, ...], state_dir: Path,
            advertise_host: str, ports: PortRange, desired_file: Path | None, token_file: TextIO | None,
            grace: float, start_timeout: float, probe_timeout: float, unhealthy_after: int,
            restart_unhealthy_after: float, heartbeat: float, allow_engines: AllowedEngines,
            max_cpu_replicas: int | None, allow_engine_args: tuple[str, ...], log_level: str | None,
            verbose: bool, log_format: str) -> None:
    """Run the node agent: start, watch and stop this machine's engines."""
    from ..agent import AgentConfig, StateLockedError, main

    if controller is None and desired_file is None:
        raise click.UsageError("give --controller URL, or --desired FILE to run without a controller")
    token = token_file.read().strip() if token_file else None
    if token_file and not token:
        raise click.BadParameter(f"{token_file.name} is empty", param_hint="--token-file")
    # -v here always meant debug (it was a flag): kept so.
    setup_logging(2 if verbose else 0, log_format, level=log_level)
    try:
        main(AgentConfig(node=node, state_dir=state_dir, ports=ports, gpus=gpus, pools=tuple(pools),
                         host=advertise_host, controller=controller, desired_file=desired_file, token=token,
                         grace=grace, start_timeout=start_timeout, heartbeat=heartbeat,
                         health=HealthPolicy(probe_timeout, unhealthy_after, restart_unhealthy_after),
                         allow_engines=allow_engines.with_args(allow_engine_args), max_cpu_replicas=max_cpu_replicas))
    except StateLockedError as exc:
        raise click.ClickException(str(exc)) from None
