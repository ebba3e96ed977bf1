"""`llmgwctl logs REPLICA [-f] [--tail N]`: an engine's log, relayed by the controller from its node's agent."""
from __future__ import annotations

import json
import sys
from urllib.parse import quote

import click

from .common import controller_headers, controller_option
from .output import visible

# Without -f the controller answers within its own limits (10 s for the agent's
# first lines); 30 s covers a slow link on top. With -f the agent sends at
# least every 10 s and the controller gives up after 30 s of silence, so 45 s
# without a byte means the controller itself is gone.
READ_TIMEOUT, FOLLOW_READ_TIMEOUT = 30.0, 45.0


@click.command("logs")
@click.argument("replica")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until Ctrl-C.")
@click.option("--tail", type=click.IntRange(min=0), default=100, show_default=True,
              help="How many of the last lines to print first (at most 10000).")
@controller_option
def command(replica: str, follow: bool, tail: int, controller: str) -> None:
    """Print a replica's engine log (REPLICA is an id from `llmgwctl status`).

    The controller asks the replica's agent for it over the connection the
    agent keeps open, so this works without any access to the node. Exit 0
    when the log was printed (or -f was stopped with Ctrl-C), 1 when it could
    not be read.
    """
    import requests

    url = controller.rstrip("/") + f"/api/v1/replicas/{quote(replica, safe='')}/logs"

    params = {"tail": str(tail), **({"follow": "1"} if follow else {})}
    try:
        resp = requests.get(url, params=params, headers=controller_headers(), stream=True,
                            timeout=(10, FOLLOW_READ_TIMEOUT if follow else READ_TIMEOUT))
    except requests.RequestException as exc:
        raise click.ClickException(f"cannot reach the controller at {controller}: {exc.__class__.__name__}; "
                                   "is `llmgwctl serve` running? (--controller or $LLMGW_CONTROLLER)") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:300]
        raise click.ClickException(visible(f"{message} (HTTP {resp.status_code})"))
    try:
        for raw in resp.iter_lines():
            if not raw:
                continue
            chunk = json.loads(raw)
            if chunk.get("lines"):
                # One line of the engine's is one line here: what is inside it (an ESC sequence, a
                # progress bar's CR) is shown escaped; tabs stay, they only move to a tab stop.
                # Flushed: -f shows each line as it comes.
                click.echo("\n".join(visible(line, keep="\t") for line in chunk["lines"]))
            if "error" in chunk:
                raise click.ClickException(visible(chunk["error"]))
            if chunk.get("done"):
                return
    except KeyboardInterrupt:
        sys.exit(0)
    except requests.RequestException as exc:
        raise click.ClickException(f"the log stream from {controller} broke off: {exc.__class__.__name__}") from None
    finally:
        resp.close()
    raise click.ClickException("the controller ended the log stream before its end (restarted?)")
