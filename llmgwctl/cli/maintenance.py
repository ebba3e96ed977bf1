"""`llmgwctl cordon|drain|uncordon NODE`: the operator's maintenance verbs, kubectl's words, sent to the controller.

Each calls `POST /api/v1/nodes/NODE/VERB` (control.maintenance) and prints
the node's state; `drain --wait` then follows `GET /api/v1/nodes/NODE`
until no replica is left on the node, or `--timeout` passes.
"""
from __future__ import annotations

import time
from typing import Any

import click

from .common import controller_headers, controller_option, refused, unreachable
from .output import visible

# A drain's answer comes at once (the work is the reconciler's); what takes
# time is --wait, which polls: twice a second shows progress promptly for a
# request that costs the controller a dictionary read.
POLL_EVERY = 0.5
# How long `drain --wait` waits by default: a replacement's cold start (the
# controller waits up to 10 minutes for one, reconciler.maintenance.SURGE_WAIT)
# and then the drain grace of the replica it replaces, with room to spare.
WAIT_TIMEOUT = 900.0
# Each call is answered at once (a drain's work is the reconciler's), bar the
# holds file's write (an fsync): 30 s leaves room for a disk in trouble before we say so.
REQUEST_TIMEOUT = 30.0


def _call(method: str, controller: str, path: str) -> dict[str, Any]:
    import requests

    url = controller.rstrip("/") + path
    try:
        resp = requests.request(method, url, headers={**controller_headers(), "Content-Type": "application/json"},
                                data=b"{}" if method == "POST" else None, timeout=REQUEST_TIMEOUT)
    except requests.RequestException as exc:
        raise unreachable(controller, exc) from None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if resp.status_code != 200 or not isinstance(body, dict):
        raise refused(resp)
    return body


def _path(node: str, verb: str = "") -> str:
    from urllib.parse import quote

    return f"/api/v1/nodes/{quote(node, safe='')}" + (f"/{verb}" if verb else "")


def _say(doc: dict[str, Any], verb: str) -> None:
    node, state = visible(str(doc.get("node"))), visible(str(doc.get("scheduling")))
    left = len(doc.get("replicas") or [])
    done = "" if doc.get("changed", True) else f" (already {state})"
    click.echo(f"node/{node} {verb}ed{done}: {state}, {left} replica{'s' if left != 1 else ''} on it"
               if verb != "uncordon" else f"node/{node} uncordoned{done}: {state}")


def _verb(verb: str, help_text: str) -> click.Command:
    @click.command(verb, help=help_text)
    @click.argument("node")
    @controller_option
    def command(node: str, controller: str) -> None:
        _say(_call("POST", controller, _path(node, verb)), verb)
    return command


cordon = _verb("cordon", """Place nothing new on NODE; what runs there keeps running and serving.

    Exit 0 when the node is cordoned (or already was), 1 when the controller
    does not know the node or cannot be reached.
    """)
uncordon = _verb("uncordon", """Make NODE placeable again (after cordon or drain).

    Replicas come back to it by ordinary placement: a scale-up, a replica
    lost elsewhere. Exit 0 when it is schedulable, 1 otherwise.
    """)


@click.command("drain")
@click.argument("node")
@click.option("--wait", is_flag=True, help="Return only once no replica is left on NODE (or --timeout passes).")
@click.option("--timeout", type=click.FloatRange(min=0), default=WAIT_TIMEOUT, show_default=True,
              metavar="SECONDS", help="With --wait: give up (exit 1) after this long; the drain goes on.")
@controller_option
def drain(node: str, wait: bool, timeout: float, controller: str) -> None:
    """Cordon NODE and move its replicas off it: replacements start elsewhere first, then NODE's replicas
    leave the router and stop once their requests in flight are done.

    Without --wait it returns at once and the controller carries the drain
    out (llmgwctl status shows the node draining, then drained). Exit 0 when
    drained (with --wait) or draining, 1 when the node is unknown, the
    controller cannot be reached, or --timeout passed first.
    """
    doc = _call("POST", controller, _path(node, "drain"))
    _say(doc, "drain")
    if not wait:
        return
    deadline = time.monotonic() + timeout
    left = len(doc.get("replicas") or [])
    while left:
        if time.monotonic() >= deadline:
            raise click.ClickException(f"node {visible(node)} still has {left} replica{'s' if left != 1 else ''} "
                                       f"after {timeout:g} s; the drain goes on (llmgwctl status)")
        time.sleep(POLL_EVERY)
        doc = _call("GET", controller, _path(node))
        left = len(doc.get("replicas") or [])
    click.echo(f"node/{visible(node)} drained")
