"""`llmgwctl token ...`: mint the credentials the control API checks (the core is control.auth)."""
from __future__ import annotations

import click


@click.group("token")
def command() -> None:
    """Mint tokens for the control API: a node token per agent."""


@command.command("node")
@click.argument("name")
@click.option("--agent-token-file", type=click.Path(dir_okay=False), metavar="FILE", required=True,
              help="The agent token the controller runs with (serve --agent-token-file): the secret node tokens are signed with.")
@click.option("--pools", default="", metavar="LABEL,...",
              help="The pools the node may claim, comma-separated [default: none].")
@click.option("--max-gpus", type=int, default=None, metavar="N",
              help="The most GPUs the node may claim; 0 for a CPU node [default: 8].")
@click.option("--advertise-host", default="", metavar="HOST",
              help="A host the node may advertise its engines on (agent --advertise-host) instead of the address "
                   "its reports come from [default: none].")
@click.option("--serial", type=int, default=0, show_default=True, metavar="N",
              help="Which token of the node this is: serve --node-revocations refuses serials below a node's minimum.")
def node(name: str, agent_token_file: str, pools: str, max_gpus: int | None, advertise_host: str, serial: int) -> None:
    """Print the token that lets an agent report and read node NAME, and claim only what the options allow."""
    from ..control.auth import TokenError, node_token, read_token_file

    labels = tuple(p.strip() for p in pools.split(",") if p.strip())
    try:
        secret = read_token_file(agent_token_file, "--agent-token-file")
        click.echo(node_token(secret, name, pools=labels, max_gpus=max_gpus, advertise_host=advertise_host.strip(),
                              serial=serial))
    except TokenError as exc:
        raise click.UsageError(str(exc)) from None
