"""`llmgwctl catalog ...`: validate, show and diff catalog files and directories."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from ..catalog import Catalog, CatalogError, format_duration, load_paths
from ..catalog.diff import diff as diff_catalogs
from .common import controller_headers, controller_option
from .output import cleaned, dump, echo, output_option, table, visible

# Seconds `catalog apply` waits for the controller's answer: its validation
# may wait for other applies (up to a minute, control.api.APPLY_QUEUE_WAIT),
# then takes seconds, then waits up to 10 s for the catalog in force.
APPLY_TIMEOUT = 120.0

paths_argument = click.argument("paths", nargs=-1, required=True,
                                type=click.Path(exists=True, file_okay=True, dir_okay=True))


def _load(paths: Sequence[str]) -> Catalog:
    """The union catalog of `paths`, or print every problem and exit 1."""
    try:
        return load_paths(paths)
    except CatalogError as exc:
        for problem in exc.problems:
            echo(visible(problem), err=True)     # a problem is one line: a newline in a name or value is escaped too
        n = len(exc.problems)
        click.echo(f"invalid: {n} problem{'s' if n != 1 else ''}", err=True)
        sys.exit(1)


@click.group("catalog")
def command() -> None:
    """Validate, show and compare model catalogs."""


@command.command()
@paths_argument
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when valid.")
def validate(paths: tuple[str, ...], quiet: bool) -> None:
    """Check catalog files or directories (together, as one catalog).

    Exit 0 when valid, 1 when not (every problem printed as
    file:line:col: path: message), 2 on a usage error.
    """
    catalog = _load(paths)
    if not quiet:
        echo(f"valid: {len(catalog)} models, {len(catalog.names())} names, version {catalog.version}")


@command.command()
@paths_argument
@output_option
def show(paths: tuple[str, ...], fmt: str) -> None:
    """Show the resolved catalog: models, aliases and profiles."""
    catalog = _load(paths)
    if fmt != "table":
        click.echo(dump(catalog.to_dict(), fmt))
        return
    rows = []
    for model in catalog.models:
        replicas = model.replicas.to_yaml()
        replicas = f"{replicas['min']}-{replicas['max']}" if isinstance(replicas, dict) else replicas
        idle = format_duration(model.idle_timeout) if model.idle_timeout is not None else "never"
        for i, p in enumerate(model.ranked()):
            first = i == 0
            rows.append((
                model.name if first else "", ",".join(model.aliases) if first else "",
                replicas if first else "", idle if first else "",
                p.name, p.engine, p.pool or "*", p.gpus, p.priority, f"{p.weight:g}",
            ))
    click.echo(table(("MODEL", "ALIASES", "REPLICAS", "IDLE", "PROFILE", "ENGINE", "POOL", "GPUS", "PRIO", "WEIGHT"), rows))
    custom = [e for e in catalog.engines.values() if not e.builtin]
    if custom:
        click.echo()
        click.echo(table(("ENGINE", "COMMAND", "HEALTH"), [(e.name, " ".join(e.command), e.health) for e in custom]))
    echo(f"\nversion {catalog.version}")


@command.command()
@click.argument("old", type=click.Path(exists=True))
@click.argument("new", type=click.Path(exists=True))
@output_option
def diff(old: str, new: str, fmt: str) -> None:
    """Show what changes from catalog OLD to NEW (files or directories).

    Exit 0 when they are the same, 1 when they differ (like diff(1)).
    """
    change = diff_catalogs(_load([old]), _load([new]))
    if fmt != "table":
        click.echo(dump(change.to_dict(), fmt))
    elif not change:
        click.echo("no changes")
    else:
        for kind, added, removed, changed in (
                ("model", change.added, change.removed, change.changed),
                ("engine", change.engines_added, change.engines_removed, change.engines_changed)):
            for name in added:
                echo(f"+ {kind} {visible(name)}")
            for name in removed:
                echo(f"- {kind} {visible(name)}")
            for name, changes in changed:
                echo(f"~ {kind} {visible(name)}")
                for c in changes:
                    echo(f"    {visible(c)}")
    sys.exit(1 if change else 0)


@command.command()
@click.option("-f", "--file", "path", required=True, type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              help="The catalog file to apply, or - for standard input; its name is the name it gets in the "
                   "catalog directory.")
@click.option("--dry-run", is_flag=True, help="Validate and show the plan; write nothing.")
@click.option("--as", "name", metavar="NAME.yaml",
              help="Name in the catalog directory [default: the file's name; required with -f -].")
@controller_option
@output_option
def apply(path: str, dry_run: bool, name: str | None, controller: str, fmt: str) -> None:
    """Validate FILE as part of the running catalog, show the plan, and put it in force.

    The controller writes the file into its catalog directory atomically, and
    its watcher takes it like any other edit. With -f - the document is read
    from standard input and --as names it. Exit 0 when applied (or the dry
    run is valid), 1 when the catalog would be invalid (nothing is written).
    """
    import os

    import requests

    from ..control.apply import filename_problem

    filename = name or os.path.basename(path)
    problem = filename_problem(filename) if path != "-" or name else None
    if problem is not None:
        # The controller refuses it the same way; asked here first so the fix is named before anything is sent.
        raise click.UsageError(visible(f"{problem}{'' if name else '; name it with --as NAME.yaml'}"),
                               ctx=click.get_current_context())
    if path == "-":
        if not name:
            raise click.UsageError("with -f - (standard input) give the file's name in the catalog directory: "
                                   "--as NAME.yaml", ctx=click.get_current_context())
        try:
            content = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.ClickException(f"standard input is not UTF-8 text: {exc}") from None
    else:
        with open(path, encoding="utf-8", errors="strict") as f:
            content = f.read()
    url = controller.rstrip("/") + "/api/v1/catalog" + ("?dry_run=1" if dry_run else "")
    try:
        resp = requests.post(url, json={"filename": filename, "content": content}, timeout=(10, APPLY_TIMEOUT),
                             headers=controller_headers())
    except requests.RequestException as exc:
        raise click.ClickException(f"cannot reach the controller at {controller}: {exc.__class__.__name__}") from None
    body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    if resp.status_code == 422:
        for line in body.get("errors", []):
            echo(visible(line), err=True)
        echo(f"rejected: {visible(body['error']['message'])}", err=True)
        sys.exit(1)
    if resp.status_code != 200:
        message = body.get("error", {}).get("message") if body else resp.text[:300]
        raise click.ClickException(visible(f"HTTP {resp.status_code}: {message}"))
    if fmt != "table":
        click.echo(dump(body, fmt))
        return
    echo(_render_plan(body))


def _render_plan(raw: dict[str, Any]) -> str:
    body = cleaned(raw)     # names, reasons and paths printable (output.visible)
    d, r = body["diff"], body["replicas"]
    lines = [f"catalog {body['from_version']} -> {body['to_version']}"]
    lines += [f"+ model {n}" for n in d["added"]] + [f"- model {n}" for n in d["removed"]]
    # The values changed are shown as repr() shows them, which escapes what a terminal would act on by itself.
    for (name, changes), shown in zip(d["changed"].items(), raw["diff"]["changed"].values()):
        lines.append(f"~ model {name}")
        lines += [f"    {c['path']}: {v['old']!r} -> {v['new']!r}" for c, v in zip(changes, shown)]
    if not (d["added"] or d["removed"] or d["changed"]):
        lines.append("no model changes")
    lines += [f"  start   {s['model']}/{s['profile']} on {s['node']} GPUs {s['gpus'] or '-'}" for s in r["start"]]
    lines += [f"  stop    {s['id']} ({s['model']}): {s['reason']}" for s in r["stop"]]
    lines += [f"  replace {s['id']} ({s['model']}/{s['profile']} on {s['node']}): {s.get('why') or 'profile changed'}"
              for s in r["replace"]]
    lines += [f"  cannot place {m}: {why}" for m, why in r["unplaceable"].items()]
    if body.get("dry_run"):
        lines.append("dry run: nothing written")
    elif body.get("in_force"):
        lines.append(f"applied: {body['written']} written, catalog {body['to_version']} in force")
    else:
        lines.append(f"written to {body['written']}; not in force yet (see llmgwctl status)")
    return "\n".join(lines)
