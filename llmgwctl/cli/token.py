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
def node(name: str, agent_token_file: str) -> None:
    """Print the token that lets an agent report and read node NAME, and no other."""
    from ..control.auth import TokenError, node_token, read_token_file

    try:
        secret = read_token_file(agent_token_file, "--agent-token-file")
        click.echo(node_token(secret, name))
    except TokenError as exc:
        raise click.UsageError(str(exc)) from None
