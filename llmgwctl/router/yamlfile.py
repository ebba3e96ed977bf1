"""Reading one of the router's own YAML files (API keys, static endpoints) into a document, within bounds.

Both files are read the same way and fail the same way: a message naming the
file and what was wrong, raised as that file's own error (a `RouterError`), so
the caller keeps its last good contents and the operator sees which file.

The bounds are those of a catalog file, for the same reasons: whoever can
write the file's directory must not be able to stall or crash the router
with it. The file is read by `fsutil.read_regular` (regular files only, never
blocking on open, at most MAX_BYTES); YAML aliases count at their expanded
size against MAX_NODES and nesting is bounded by MAX_DEPTH, both checked on
the event stream before anything is composed.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from ..fsutil import UnusableFile, read_regular
from ..yamlkit import LOADER, NodeCount

# One catalog file's cap. A key is ~120 bytes of YAML and an endpoint ~100, so
# this holds 35,000 keys or 40,000 endpoints; a file past it is not one an
# operator wrote, and parsing 30 MB took the router's loop 23 s.
MAX_BYTES = 4 << 20
# Nodes with every alias expanded: a key or an endpoint is ~12 nodes, so this
# is room for the largest file above with anchors shared between entries, and
# a 1 KB alias bomb (billions of nodes) is refused after 500,000 events.
MAX_NODES = 500_000
# Both files are 4 levels deep (keys[i].models[j]); libyaml's composer
# recurses on the C stack and crashes the process near 100,000 levels.
MAX_DEPTH = 32


def load_yaml(path: str | os.PathLike[str], error: type[Exception], what: str = "file") -> Any:
    """The parsed document in `path` (UTF-8), or `error` saying it cannot be read or is not YAML. Blocking."""
    path = os.fspath(path)
    try:
        data = read_regular(path, MAX_BYTES, what)
    except UnusableFile as exc:
        raise error(str(exc)) from None
    return parse_yaml(data, path, error)


def parse_yaml(data: bytes, source: str, error: type[Exception]) -> Any:
    """The document in `data`, or `error` naming `source` and why it is not bounded, UTF-8 YAML."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{source}: not UTF-8 (byte {exc.start}); save the file as UTF-8") from None
    try:
        refused = _measure(text)
        if refused:
            raise error(f"{source}: {refused}")
        return yaml.load(text, Loader=LOADER)
    except yaml.YAMLError as exc:
        raise error(f"{source}: not valid YAML: {exc}") from None
    except (ValueError, TypeError, OverflowError, ArithmeticError) as exc:
        # An explicit tag whose value does not fit it (`!!float abc`): PyYAML lets the conversion's error through.
        raise error(f"{source}: invalid YAML value: {str(exc)[:80]}") from None


@dataclass(frozen=True)
class Layout:
    """How one of these files is laid out: a mapping holding one list, `key`, of mappings with known fields."""

    key: str                        # the list's key ("keys", "endpoints")
    fields: frozenset[str]          # what an entry may hold
    required: tuple[str, ...]       # what it must, in the order a missing one is named
    example: str                    # what the file looks like, for one that is not laid out so
    entry: str                      # what an entry looks like, for one that is not a mapping
    some_of: bool = False           # the fields are named as "some of" them (most are optional)
    blank_is_missing: bool = False  # a required field that is empty counts as missing
    hint: Callable[[str], str] = lambda unknown: ""     # said after an unknown field's problem


def entries(doc: Any, layout: Layout, source: str, error: type[Exception],
            problems: list[str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(index, where, entry) for each entry of the file's list that has the fields `layout` says.

    `error` says what the file should look like when it is not a mapping
    holding that list. Every other problem -- an entry that is not a mapping,
    holds a field not in `layout.fields` or lacks a required one -- is noted
    in `problems` as `FILE: key[i]...: what` and the entry skipped, so every
    entry's problems are reported at once. `where` is that `FILE: key[i]`.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get(layout.key), list):
        article = "an" if layout.key[:1] in ("a", "e", "i", "o", "u") else "a"
        raise error(f"{source}: expected a mapping with {article} {layout.key!r} list, e.g. {layout.example}")
    expected = ("some of " if layout.some_of else "") + ", ".join(sorted(layout.fields))
    for i, raw in enumerate(doc[layout.key]):
        where = f"{source}: {layout.key}[{i}]"
        if not isinstance(raw, dict):
            problems.append(f"{where}: {layout.entry}")
            continue
        unknown = sorted(set(raw) - layout.fields, key=str)
        if unknown:
            problems.append(f"{where}: unknown field {unknown[0]!r}; expected {expected}{layout.hint(unknown[0])}")
            continue
        missing = [f for f in layout.required if (not raw.get(f) if layout.blank_is_missing else f not in raw)]
        if missing:
            problems.append(f"{where}.{missing[0]}: required")
            continue
        yield i, where, raw


def _measure(text: str) -> str | None:
    """Why the document is refused before it is composed (too many nodes, too deep, recursive), or None.

    The event parser keeps its own stack, so neither depth nor an alias bomb
    costs more than the events up to where the bound runs out. An alias adds
    the size of what it names without expanding it.
    """
    loader = LOADER(text)
    count = NodeCount()
    try:
        while loader.check_event():
            event = loader.get_event()
            line = getattr(event.start_mark, "line", -1) + 1
            recursive = count.add(event)
            if recursive is not None:
                return f"line {line}: alias *{recursive[:40]} refers to a node that contains it"
            if count.depth > MAX_DEPTH:
                return f"line {line}: nested more than {MAX_DEPTH} levels deep; this file is 4"
            if count.nodes > MAX_NODES:
                return (f"line {line}: holds more than {MAX_NODES} YAML nodes (each alias counted at the size "
                        "of what it repeats); not parsed")
    finally:
        loader.dispose()
    return None
