"""`llmgwctl logs REPLICA [-f] [--tail N]`: an engine's log, relayed by the controller from its node's agent;
`llmgwctl logs --requests [--model M] [--status S] [--id ID]`: the last requests the routers answered."""
from __future__ import annotations

import json
import sys
import time
from urllib.parse import quote

import click

from .common import controller_headers, controller_option, refused, unreachable
from .output import FORMATS, dump, echo, table, visible

# Without -f the controller answers within its own limits (10 s for the agent's
# first lines); 30 s covers a slow link on top. With -f the agent sends at
# least every 10 s and the controller gives up after 30 s of silence, so 45 s
# without a byte means the controller itself is gone.
READ_TIMEOUT, FOLLOW_READ_TIMEOUT = 30.0, 45.0


@click.command("logs")
@click.argument("replica", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until Ctrl-C.")
@click.option("--tail", type=click.IntRange(min=0), default=100, show_default=True,
              help="How many of the last lines to print first (at most 10000).")
@click.option("--requests", "request_log", is_flag=True,
              help="Print the last requests the routers answered instead of an engine's log.")
@click.option("--model", help="With --requests: only requests that asked for or were served by MODEL.")
@click.option("--status", help="With --requests: a code (503), a class (5xx) or 'error'.")
@click.option("--id", "request_id", help="With --requests: a request id, or its start.")
@click.option("-o", "--output", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="With --requests: table for people; json or yaml for scripts.")
@controller_option
def command(replica: str | None, follow: bool, tail: int, request_log: bool, model: str | None, status: str | None,
            request_id: str | None, fmt: str, controller: str) -> None:
    """Print a replica's engine log (REPLICA is an id from `llmgwctl status`), or with --requests the
    last requests the routers answered (the console's request log).

    The controller asks the replica's agent for it over the connection the
    agent keeps open, so this works without any access to the node. Exit 0
    when the log was printed (or -f was stopped with Ctrl-C), 1 when it could
    not be read.
    """
    import requests

    if request_log:
        if replica is not None or follow:
            raise click.UsageError("--requests takes no REPLICA and no -f")
        _requests(controller, model, status, request_id, tail, fmt)
        return
    if replica is None:
        raise click.UsageError("give a REPLICA (an id from `llmgwctl status`), or --requests")
    if model or status or request_id:
        raise click.UsageError("--model, --status and --id go with --requests")

    url = controller.rstrip("/") + f"/api/v1/replicas/{quote(replica, safe='')}/logs"

    params = {"tail": str(tail), **({"follow": "1"} if follow else {})}
    try:
        resp = requests.get(url, params=params, headers=controller_headers(), stream=True,
                            timeout=(10, FOLLOW_READ_TIMEOUT if follow else READ_TIMEOUT))
    except requests.RequestException as exc:
        raise unreachable(controller, exc) from None
    if resp.status_code != 200:
        raise refused(resp)
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


def _requests(controller: str, model: str | None, status: str | None, request_id: str | None, limit: int,
              fmt: str) -> None:
    """GET /api/v1/requests (control.requestlog), printed newest first."""
    import requests

    params = {"limit": str(limit), **{k: v for k, v in (("model", model), ("status", status), ("id", request_id)) if v}}
    try:
        resp = requests.get(controller.rstrip("/") + "/api/v1/requests", params=params, headers=controller_headers(),
                            timeout=READ_TIMEOUT)
    except requests.RequestException as exc:
        raise unreachable(controller, exc) from None
    if resp.status_code != 200:
        raise refused(resp)
    body = resp.json()
    if fmt != "table":
        echo(dump(body["requests"], fmt))
        return
    rows = [(time.strftime("%H:%M:%S", time.localtime(r["at"])), r["id"], r["key"] or "-",
             r["model"] or "-" if r["asked"] in (r["model"], "") else f"{r['model'] or '-'} ({r['asked']})",
             r["status"], "-" if r["ttft"] is None else f"{r['ttft'] * 1000:.0f}ms",
             f"{'-' if r['tokens_in'] is None else r['tokens_in']}/{'-' if r['tokens_out'] is None else r['tokens_out']}",
             r["replica"] or "-", r["error"] or "") for r in body["requests"]]
    echo(table(("TIME", "REQUEST ID", "KEY", "MODEL (ASKED)", "STATUS", "TTFT", "TOKENS", "REPLICA", "ERROR"), rows))
