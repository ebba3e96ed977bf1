"""`llmgwctl status`: what the controller has in force and what runs where, as tables or -o json|yaml."""
from __future__ import annotations

import sys
import time
from typing import Any

import click

from .common import controller_headers, controller_option, unreachable
from .output import cleaned, dump, echo, table, visible


def _load(scale: dict[str, Any] | None) -> str:
    """`12/16 inflight (1)`: the model's load summed over ready replicas, the target per replica, and
    what that load needs; `-` before a reading (or from a controller without autoscaling)."""
    if not scale or scale.get("target") is None:
        return "-"
    load = "-" if scale.get("load") is None else f"{scale['load']:.4g}"
    needed = "" if scale.get("needed") is None else f" ({scale['needed']})"
    return f"{load}/{scale['target']:g} {scale['metric']}{needed}"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _cut(text: object, width: int) -> str:
    shown = "" if text is None else str(text)
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def _cut_left(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _wrap(text: str) -> list[str]:
    import textwrap
    return textwrap.wrap(text, width=100, initial_indent="  ", subsequent_indent="    ")


def _degraded_loops(status: dict[str, Any], now: float) -> list[str]:
    """A line per supervised loop whose last pass failed (which, how often, when), then its error."""
    reconciler = status.get("reconciler") or {}
    out = []
    for name, state, part in (("catalog watcher", status["catalog"].get("watcher"), status["catalog"]),
                              ("reconciler", reconciler.get("loop"), reconciler)):
        if state != "degraded":
            continue
        if part.get("problem"):
            out.append(f"{name} DEGRADED: cannot follow the directory; the catalog above stays in force "
                       "until it can:")
            out.extend(_wrap(str(part["problem"])))
            continue
        last = part.get("last_failure") or {}
        when = _ago(now - last["at"]) if last.get("at") else "-"
        out.append(_cut(f"{name} DEGRADED: {part.get('failures', 0)} failed passes, the last {when} "
                        f"({last.get('what', '?')}); it goes on, the server log has the traceback:", 100))
        out.append(_cut(f"  {last.get('error', '?')}", 100))
    for w in status.get("watchers") or ():
        # The catalog's own lines are above.
        if w.get("state") != "degraded" or w.get("name") == "catalog":
            continue
        since = _ago(now - w["since"]) if w.get("since") else "-"
        out.append(_cut(f"{w['name']} file DEGRADED since {since} ({w.get('failures', 0)} problems so far); "
                        "what was in force stays:", 100))
        out.extend(_wrap(str(w.get("problem") or "?")))
    return out


# Log lines shown under a replica that is not ready: the end of a crash is
# where its reason is; `llmgwctl logs ID` has the rest.
LOG_LINES = 5
# Past this many replicas (or nodes) the table lists only the ones that are
# not ready, under a count by state: 200 rows is a few screens, and at fleet
# size (tens of thousands of replicas) a table of every one is searched, not read.
# `-o wide`, `--model` and `-o json` still show every one.
SUMMARY_ABOVE = 200


def _tally(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    return ", ".join(f"{n:,} {state}" for state, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _state(replica: dict[str, Any]) -> str:
    """The state, with how long a load has taken so far while it starts."""
    since = replica.get("starting_seconds")
    return replica["state"] if since is None else f"{replica['state']} {_ago(since).removesuffix(' ago')}"


def render(status: dict[str, Any], now: float | None = None, events: int = 8, wide: bool = False, every: bool = False) -> str:
    """The status as tables. Ids, GPUs, engines and endpoints are never cut (an id is what
    `llmgwctl logs` takes, and `0,1,…` hides which GPUs); `wide` cuts nothing and adds columns.
    Past SUMMARY_ABOVE rows only those not ready are listed, unless `wide` or `every`."""
    now = time.time() if now is None else now
    status = cleaned(status)    # every name, label, message and log line printable as it is (see output.visible)
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
    out.append(table(("MODEL", "ALIASES", "DESIRED", "READY", "REPLICAS", "LOAD/TARGET"), [
        (_cut(m["name"], 40), _cut(",".join(m["aliases"]), 30), m["desired"], m["ready"],
         f"{m['min']}-{m['max']}" if m["min"] != m["max"] else m["min"], _load(m.get("autoscale")))
        for m in status["models"]]))
    ready = {m["name"]: m["ready"] for m in status["models"]}
    for m in status["models"]:
        if m.get("fallbacks"):
            # The chain in the order tried, each with its ready count: what would answer if this model could not.
            out.extend(_wrap(f"{m['name']} falls back to " + " -> ".join(
                f"{name} ({ready.get(name, 0)} ready)" for name in m["fallbacks"])))
    for m in status["models"]:
        for a in m.get("adapters") or ():
            # Only the adapters whose spread follows their load: a fixed one's holders are on the replica lines.
            if a.get("max") is not None and a.get("min") is not None and a["max"] > a["min"]:
                out.extend(_wrap(f"adapter {a['name']} of {m['name']} {a['reason']}"))
    for m in status["models"]:
        if m.get("unplaceable"):
            never = " (never, with this fleet)" if m.get("unplaceable_permanent") else ""
            out.extend(_wrap(f"cannot place {m['name']}{never}: {m['unplaceable']}"))
    cut = (lambda text, width: "" if text is None else str(text)) if wide else _cut
    replicas = status["replicas"]
    if replicas and not (wide or every) and len(replicas) > SUMMARY_ABOVE:
        out.append("")
        out.extend(_wrap(f"{len(replicas):,} replicas: {_tally(replicas)}"))
        out.append("  those not ready (or held out of routing) below; --model NAME or -o wide lists every one")
        # A ready replica the router keeps out of routing (ejected, wedged) is as much a problem as
        # one not ready: hiding it would leave the line that says why unread.
        replicas = [r for r in replicas if r["state"] != "ready" or r.get("router")]
    if replicas:
        out.append("")
        headers = ("REPLICA", "PROFILE", "NODE", "GPUS", "STATE", "ENDPOINT", "RST", "USED")
        out.append(table(headers + (("MODEL", "ENGINE", "PID", "EXIT") if wide else ()), [
            (r["id"], cut(r["profile"], 10) + ("*" if r.get("fallback") else ""), cut(r["node"], 16),
             ",".join(map(str, r["gpus"])) or "-",
             _state(r), (r.get("url") or "-").replace("http://", ""), r["restarts"],
             _ago(r.get("idle_seconds")).replace(" ago", ""))
            + ((r["model"], r["engine"], r.get("pid") or "-", "-" if r.get("last_exit") is None else r["last_exit"])
               if wide else ())
            for r in replicas]))
        if any(r.get("fallback") for r in replicas):
            out.append("  * a fallback profile: moved back to the best one when it fits")
        for r in replicas:
            if r.get("router"):
                out.extend(_wrap(f"{r['id']} {r['state']}: {r['router']}"))
            members = r.get("members") or []
            if members:
                # A replica spanning nodes is one row; its members, rank by rank, on one line.
                out.extend(_wrap(f"{r['id']} spans {len(members)} nodes: " + ", ".join(
                    f"rank {m['rank']} {m['node']} GPUs {','.join(map(str, m['gpus'])) or '-'} {m['state']}"
                    for m in members)))
                for m in members:
                    if m["state"] != "ready" and m.get("reason"):
                        out.extend(_wrap(f"{m['id']} {m['state']}: {m['reason']}"))
            adapters = r.get("adapters") or []
            if adapters:
                # One line a replica: each adapter placed on it and where its load stands
                # (with llama.cpp's number for it, which its requests name it by).
                out.extend(_wrap(f"{r['id']} adapters: " + ", ".join(_adapter_cell(a) for a in adapters)))
                for a in adapters:
                    if a.get("reason"):
                        out.extend(_wrap(f"{r['id']} adapter {a['name']} {a['state']}: {a['reason']}"))
            if r["state"] == "ready":
                continue
            why = r.get("reason") or ""
            if r.get("last_exit") is not None and f"code {r['last_exit']}" not in why:
                why = f"{why} (last exit {r['last_exit']})" if why else f"last exit {r['last_exit']}"
            if why:
                out.extend(_wrap(f"{r['id']} {r['state']}: {why}"))
            lines = r.get("last_log") or []
            if lines:
                shown = lines if wide else lines[-LOG_LINES:]
                out.append(f"  last {len(shown)} log lines (llmgwctl logs {r['id']}):")
                out.extend(f"    | {line}" if wide else _cut(f"    | {line}", 100) for line in shown)
    nodes = status["nodes"]
    if nodes and not (wide or every) and len(nodes) > SUMMARY_ABOVE:
        out.append("")
        out.extend(_wrap(f"{len(nodes):,} nodes: {_tally(nodes)}; GPUs used "
                         f"{sum(n['gpus_used'] for n in nodes):,}/{sum(n['gpus'] for n in nodes):,}"))
        out.append("  those not ready, cordoned (or refusing a second agent) below; -o wide lists every one")
        nodes = [n for n in nodes if n["state"] != "ready" or n.get("conflict") or n.get("refused")
                 or n.get("scheduling", "schedulable") != "schedulable"]
    if nodes:
        out.append("")
        # SCHEDULING: whether placement may use it (llmgwctl cordon, drain, uncordon); a controller
        # older than the field says nothing, and its nodes are all schedulable.
        out.append(table(("NODE", "STATE", "SCHEDULING", "POOLS", "GPUS USED", "ENGINES", "LAST SEEN"), [
            (cut(n["name"], 24), n["state"], n.get("scheduling", "schedulable"), cut(",".join(n["pools"]) or "-", 24),
             f"{n['gpus_used']}/{n['gpus']}",
             ",".join(n["engines"]) or "-", _ago(n["last_seen_seconds"]))
            for n in nodes]))
        for n in nodes:
            if n.get("conflict"):
                out.extend(_wrap(f"{n['name']} conflict: {n['conflict']}"))
            for refused in n.get("refused") or ():
                out.extend(_wrap(f"{n['name']} refused: {refused}"))
    if status.get("events") and events:
        out.append("")
        out.append("RECENT EVENTS")
        for e in status["events"][-events:]:
            out.append(_cut(f"  {_ago(now - e['at']):>8}  {e['kind']}: {e['message']}", 100))
    return "\n".join(out)


def fetch(controller: str, model: str | None = None) -> dict[str, Any]:
    import requests

    try:
        resp = requests.get(controller.rstrip("/") + "/api/v1/status", timeout=10, headers=controller_headers(),
                            params={"model": model} if model else None)
    except requests.RequestException as exc:
        raise unreachable(controller, exc) from None
    if resp.status_code != 200:
        raise click.ClickException(visible(f"{controller} answered HTTP {resp.status_code}: {resp.text[:300]}"))
    status: dict[str, Any] = resp.json()   # the controller's status document (contracts.status)
    return status


@click.command("status")
@controller_option
@click.option("-o", "--output", "fmt", type=click.Choice(("table", "wide", "json", "yaml")), default="table",
              show_default=True, help="table for people (wide: nothing cut, more columns); json or yaml for scripts.")
@click.option("--watch", "-w", is_flag=True, help="Redraw every 2 seconds until Ctrl-C.")
@click.option("--model", "-m", metavar="NAME", help="Only this model (name or alias): its replicas and their nodes.")
def command(controller: str, fmt: str, watch: bool, model: str | None) -> None:
    """Show the catalog in force, models, replicas, nodes and recent events."""
    while True:
        status = fetch(controller, model)
        # Asked for one model: every one of its rows, however many.
        text = dump(status, fmt) if fmt in ("json", "yaml") else render(status, wide=fmt == "wide",
                                                                        every=model is not None)
        if watch:
            click.clear()
        echo(text)
        if not watch:
            return
        try:
            time.sleep(2)
        except KeyboardInterrupt:
            sys.exit(0)


def _adapter_cell(a: dict[str, Any]) -> str:
    if a["state"] != "loaded":
        return f"{a['name']} ({a['state']})"
    return a["name"] if a.get("engine_id") is None else f"{a['name']} (id {a['engine_id']})"
