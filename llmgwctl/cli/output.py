r"""How CLI commands print: aligned tables for people, `-o json|yaml` for scripts.

Everything a command prints for people goes through `visible` (tables, the
lines of `status`, `logs`, plans and errors): file names, pool labels, node
names, log lines, event and error messages come from catalogs, nodes, engines
and the server, and any of them may carry an ESC sequence (clear the screen,
retitle the window, a hyperlink), a carriage return or backspaces that
overwrite what was printed, or a bidi override (U+202E) that shows text in
another order than it reads. They are printed as visible escapes (`\x1b`,
`\r`, `\u202e`), never sent to the terminal as they are. A backslash is left
as it is: the point is that the terminal shows what is there, and a log line's
own backslashes are more common than a name spelling an escape. `-o json`
escapes by itself (json.dumps writes only ASCII); `-o yaml` falls back to
escapes when a value holds such a character.
"""
from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import click

# What a terminal may act on rather than show: the C0 controls and DEL (ESC,
# CR, BS, BEL, ...), the C1 controls (0x9b is a one-byte CSI to some
# terminals), the line and paragraph separators, and Unicode's format
# characters -- bidi embeddings, overrides and isolates, zero-width ones --
# found by category (Cf) so a new one is covered too. Lone surrogates cannot
# be printed at all.
_UNSAFE_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
_CANDIDATE = re.compile(r"[^\x20-\x7e]")     # ASCII printables are never unsafe: only the rest is looked up


# The three every reader knows by their short escapes, as Python's repr writes them.
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(ch: str) -> str:
    short = _SHORT.get(ch)
    if short is not None:
        return short
    n = ord(ch)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def visible(text: Any, keep: str = "") -> str:
    """`text` as a terminal shows it safely: every control, format or separator character escaped.

    `keep` names characters printed as they are (`logs` keeps tabs; a block
    of lines keeps its newlines). None is "".
    """
    shown = "" if text is None else str(text)
    if not _CANDIDATE.search(shown):
        return shown

    def one(match: re.Match[str]) -> str:
        ch = match.group()
        if ch in keep or unicodedata.category(ch) not in _UNSAFE_CATEGORIES:
            return ch
        return _escape(ch)
    return _CANDIDATE.sub(one, shown)



def cleaned(data: Any) -> Any:
    """A JSON-like document with every string in it (keys too) made `visible`: for renderers that
    pick fields out of a server's answer, so none of them can miss one."""
    if isinstance(data, str):
        return visible(data)
    if isinstance(data, dict):
        return {visible(k) if isinstance(k, str) else k: cleaned(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [cleaned(v) for v in data]
    return data


def echo(text: Any = "", err: bool = False) -> None:
    """click.echo for text meant for people: one or more lines, each made `visible` (newlines kept)."""
    click.echo(visible(text, keep="\n"), err=err)

FORMATS = ("table", "json", "yaml")

output_option = click.option(
    "-o", "--output", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
    help="table for people; json or yaml for scripts.")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns; every cell `visible`, so a newline or an escape in one cannot break the rows."""
    cells = [[visible(h) for h in headers]] + [[visible(c) for c in row] for row in rows]
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
    # And PyYAML writes a bidi override or another format character raw with
    # allow_unicode: escaped, like the tables, if the text holds one.
    c_loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    if visible(text, keep="\n") != text or yaml.safe_load(text) != data or yaml.load(text, Loader=c_loader) != data:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False)
    # Only the final newline goes: str.rstrip() would also eat a trailing
    # U+00A0 that belongs to the last value.
    return text.rstrip("\n")
