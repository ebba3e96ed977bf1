"""How CLI commands print: aligned tables for people, `-o json|yaml` for scripts."""
from __future__ import annotations

import json
from typing import Any, Sequence

import click

FORMATS = ("table", "json", "yaml")

output_option = click.option(
    "-o", "--output", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
    help="table for people; json or yaml for scripts.")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def dump(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False)
    import yaml
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    # PyYAML writes some characters raw that its reader then takes for line
    # breaks (U+0085 in a quoted scalar); fall back to escapes rather than
    # print a catalog that does not read back as itself.
    if yaml.safe_load(text) != data:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False)
    return text.rstrip()
