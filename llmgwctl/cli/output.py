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
    # PyYAML writes some characters raw that a reader then takes for something
    # else (U+0085 in a quoted scalar reads as a line break; libyaml, which our
    # loader uses, trims a plain scalar's trailing U+00A0, so '0\xa0' reads
    # back as 0). Fall back to escapes rather than print a catalog that does not
    # read back as itself, whichever YAML library reads it.
    c_loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    if yaml.safe_load(text) != data or yaml.load(text, Loader=c_loader) != data:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False)
    # Only the final newline goes: str.rstrip() would also eat a trailing
    # U+00A0 that belongs to the last value.
    return text.rstrip("\n")
