"""The catalog's errors, in one place.

    CatalogError                 a directory, file or document that is not a valid catalog
     └ carries Problem...        one thing wrong: file, line, column, path in the document, message

Every check (YAML syntax, JSON Schema, cross-file rules) adds Problems to one list,
so an operator sees everything wrong with a directory at once instead of fixing
it one error per round trip.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def format_path(path: Sequence[str | int]) -> str:
    """`("models", 2, "profiles", 0, "engine")` -> `models[2].profiles[0].engine`."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            # A key is text from the file: shown, but only as a short excerpt
            # (a pasted token as a key must not reach status and logs whole).
            key = str(key) if len(str(key)) <= 40 else str(key)[:40] + "..."
            out += f".{key}" if out else key
    return out


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a catalog, located as precisely as we can.

    `line`/`column` are 1-based and 0 when unknown (a file that cannot be
    decoded has no lines to point at, a rule about the whole directory no file).
    """

    file: str
    path: tuple[str | int, ...]
    message: str
    line: int = 0
    column: int = 0

    def __str__(self) -> str:
        # file:line:col: path: message -- the form editors and CI annotate.
        where = self.file or "<catalog>"
        if self.line:
            where += f":{self.line}:{self.column or 1}"
        if self.path:
            return f"{where}: {format_path(self.path)}: {self.message}"
        return f"{where}: {self.message}"

    def sort_key(self) -> tuple[str, int, int, str, str]:

        return (self.file, self.line, self.column, format_path(self.path), self.message)


class CatalogError(Exception):
    """A catalog that is not valid; `problems` lists every reason, sorted by place."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = tuple(sorted(problems, key=Problem.sort_key))
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.problems)


# How much of a line or value a message may quote. An error must let the
# operator find the spot, and must never print a file (a secret in the wrong
# place, a link to a token) into status and logs.
EXCERPT = 40


def excerpt(value: object, limit: int = EXCERPT) -> str:
    """`repr(value)`, cut to a short excerpt: what errors may quote of a file."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
