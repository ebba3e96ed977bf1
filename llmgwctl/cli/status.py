"""`llmgwctl status`: what the controller has in force and what runs where, as tables or -o json|yaml."""
from __future__ import annotations

import sys
import time

import click

from .common import controller_headers, controller_option
from .output import dump, output_option, table


def _ago(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _cut(text, width: int) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _cut_left(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _wrap(text: str) -> list[str]:
    import textwrap
    return textwrap.wrap(text, width=100, initial_indent="  ", subsequent_indent="    ")


def _degraded_loops(status: dict, now: float) -> list[str]:
    """A line per supervised loop whose last pass failed (which, how often, when), then its error."""
    reconciler = status.get("reconciler") or {}
    out = []
    for name, state, part in (("catalog watcher", status["catalog"].get("watcher"), status["catalog"]),
                              ("reconciler", reconciler.get("loop"), reconciler)):
        if state != "degraded":
            continue
        last = part.get("last_failure") or {}
        when = _ago(now - last["at"]) if last.get("at") else "-"
        out.append(_cut(f"{name} DEGRADED: {part.get('failures', 0)} failed passes, the last {when} "
                        f"({last.get('what', '?')}); it goes on, the server log has the traceback:", 100))
        out.append(_cut(f"  {last.get('error', '?')}", 100))
    return out


def render(status: dict, now: float | None = None, events: int = 8) -> str:
    """The status as tables that fit a 100-column terminal."""
    now = time.time() if now is None else now
    cat = status["catalog"]
    swapped = now - cat["swapped_at"] if cat.get("swapped_at") else None
    out = [f"catalog {cat['version']}: {cat['models']} models, in force since {_ago(swapped)}"
           + ("" if status.get("settled", True) else "  (settling: adopting running replicas)"),
           f"  from {_cut_left(cat['directory'], 92)}"]
    rejection = cat.get("last_rejection")
    if rejection and not cat.get("directory_valid", True):
        out.append(f"last edit REJECTED {_ago(now - rejection['at'])}; the catalog above stays in force:")
        out.extend(f"  {e}" for e in rejection["errors"][:10])
        if len(rejection["errors"]) > 10:
            out.append(f"  ... {len(rejection['errors']) - 10} more")
    out.extend(_degraded_loops(status, now))
    out.append("")
    out.append(table(("MODEL", "ALIASES", "DESIRED", "READY", "REPLICAS"), [
        (_cut(m["name"], 40), _cut(",".join(m["aliases"]), 30), m["desired"], m["ready"],
         f"{m['min']}-{m['max']}" if m["min"] != m["max"] else m["min"])
        for m in status["models"]]))
    for m in status["models"]:
        if m.get("unplaceable"):
            never = " (never, with this fleet)" if m.get("unplaceable_permanent") else ""
            out.extend(_wrap(f"cannot place {m['name']}{never}: {m['unplaceable']}"))
    if status["replicas"]:
        out.append("")
        out.append(table(("REPLICA", "PROFILE", "NODE", "GPUS", "STATE", "ENDPOINT", "RST", "USED"), [
            (_cut(r["id"], 24), _cut(r["profile"], 9) + ("*" if r.get("fallback") else ""), _cut(r["node"], 10), _cut(",".join(map(str, r["gpus"])) or "-", 5),
             r["state"], _cut((r.get("url") or "-").replace("http://", ""), 21), r["restarts"],
             _ago(r.get("idle_seconds")).replace(" ago", ""))
            for r in status["replicas"]]))
        if any(r.get("fallback") for r in status["replicas"]):
            out.append("  * a fallback profile: moved back to the best one when it fits")
        for r in status["replicas"]:
            if r.get("reason") and r["state"] != "ready":
                out.extend(_wrap(f"{r['id']} {r['state']}: {r['reason']}"))
    if status["nodes"]:
        out.append("")
        out.append(table(("NODE", "STATE", "POOLS", "GPUS USED", "ENGINES", "LAST SEEN"), [
            (_cut(n["name"], 16), n["state"], _cut(",".join(n["pools"]) or "-", 16), f"{n['gpus_used']}/{n['gpus']}",
             _cut(",".join(n["engines"]) or "-", 24), _ago(n["last_seen_seconds"]))
            for n in status["nodes"]]))
        for n in status["nodes"]:
            if n.get("conflict"):
                out.extend(_wrap(f"{n['name']} conflict: {n['conflict']}"))
    if status.get("events") and events:
        out.append("")
        out.append("RECENT EVENTS")
        for e in status["events"][-events:]:
            out.append(_cut(f"  {_ago(now - e['at']):>8}  {e['kind']}: {e['message']}", 100))
    return "\n".join(out)


def fetch(controller: str) -> dict:
    import requests

    try:
        resp = requests.get(controller.rstrip("/") + "/api/v1/status", timeout=10, headers=controller_headers())
    except requests.RequestException as exc:
        raise click.ClickException(f"cannot reach the controller at {controller}: {exc.__class__.__name__}; "
                                   "is `llmgwctl serve` running? (--controller or $LLMGW_CONTROLLER)") from None
    if resp.status_code != 200:
        raise click.ClickException(f"{controller} answered HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


@click.command("status")
@controller_option
@output_option
@click.option("--watch", "-w", is_flag=True, help="Redraw every 2 seconds until Ctrl-C.")
def command(controller, fmt, watch):
    """Show the catalog in force, models, replicas, nodes and recent events."""
    while True:
        status = fetch(controller)
        text = dump(status, fmt) if fmt != "table" else render(status)
        if watch:
            click.clear()
        click.echo(text)
        if not watch:
            return
        try:
            time.sleep(2)
        except KeyboardInterrupt:
            sys.exit(0)
