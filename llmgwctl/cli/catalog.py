"""`llmgwctl catalog ...`: validate, show and diff catalog files and directories."""
from __future__ import annotations

import sys

import click

from ..catalog import CatalogError, format_duration, load_paths
from ..catalog.diff import diff as diff_catalogs
from .output import dump, output_option, table

paths_argument = click.argument("paths", nargs=-1, required=True,
                                type=click.Path(exists=True, file_okay=True, dir_okay=True))


def _load(paths):
    """The union catalog of `paths`, or print every problem and exit 1."""
    try:
        return load_paths(paths)
    except CatalogError as exc:
        for problem in exc.problems:
            click.echo(str(problem), err=True)
        n = len(exc.problems)
        click.echo(f"invalid: {n} problem{'s' if n != 1 else ''}", err=True)
        sys.exit(1)


@click.group("catalog")
def command() -> None:
    """Validate, show and compare model catalogs."""


@command.command()
@paths_argument
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when valid.")
def validate(paths, quiet):
    """Check catalog files or directories (together, as one catalog).

    Exit 0 when valid, 1 when not (every problem printed as
    file:line:col: path: message), 2 on a usage error.
    """
    catalog = _load(paths)
    if not quiet:
        click.echo(f"valid: {len(catalog)} models, {len(catalog.names())} names, version {catalog.version}")


@command.command()
@paths_argument
@output_option
def show(paths, fmt):
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
    click.echo(f"\nversion {catalog.version}")


@command.command()
@click.argument("old", type=click.Path(exists=True))
@click.argument("new", type=click.Path(exists=True))
@output_option
def diff(old, new, fmt):
    """Show what changes from catalog OLD to NEW (files or directories).

    Exit 0 when they are the same, 1 when they differ (like diff(1)).
    """
    change = diff_catalogs(_load([old]), _load([new]))
    if fmt != "table":
        click.echo(dump(change.to_dict(), fmt))
    elif not change:
        click.echo("no changes")
    else:
        for name in change.added:
            click.echo(f"+ model {name}")
        for name in change.removed:
            click.echo(f"- model {name}")
        for name, changes in change.changed:
            click.echo(f"~ model {name}")
            for c in changes:
                click.echo(f"    {c}")
        for name in change.engines_added:
            click.echo(f"+ engine {name}")
        for name in change.engines_removed:
            click.echo(f"- engine {name}")
        for name, changes in change.engines_changed:
            click.echo(f"~ engine {name}")
            for c in changes:
                click.echo(f"    {c}")
    sys.exit(1 if change else 0)
