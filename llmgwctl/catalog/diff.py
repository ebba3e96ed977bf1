"""What changed between two catalogs, model by model and field by field.

Used for the watcher's log line on every swap, `llmgwctl catalog diff`, and
`catalog apply --dry-run`. Works on the catalogs' canonical documents, so it
sees exactly what the version hash sees: a reformatted file is no change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from .errors import format_path
from .model import Catalog


@dataclass(frozen=True, slots=True)
class Change:
    path: tuple[str | int, ...]   # inside the model (or engine) document
    old: Any                      # None where the field was absent
    new: Any

    def __str__(self) -> str:
        return f"{format_path(self.path)}: {_show(self.old)} -> {_show(self.new)}"


@dataclass(frozen=True, slots=True)
class CatalogDiff:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[tuple[str, tuple[Change, ...]], ...] = ()
    engines_added: tuple[str, ...] = ()
    engines_removed: tuple[str, ...] = ()
    engines_changed: tuple[tuple[str, tuple[Change, ...]], ...] = ()

    def __bool__(self) -> bool:
        return any((self.added, self.removed, self.changed, self.engines_added, self.engines_removed, self.engines_changed))

    def summary(self) -> str:
        """One line for logs: `+a +b -c ~d(profiles[0].args)`."""
        parts = [f"+{n}" for n in self.added] + [f"-{n}" for n in self.removed]
        parts += [f"~{n}({', '.join(format_path(c.path) for c in cs)})" for n, cs in self.changed]
        parts += [f"+engine:{n}" for n in self.engines_added] + [f"-engine:{n}" for n in self.engines_removed]
        parts += [f"~engine:{n}" for n, _ in self.engines_changed]
        return " ".join(parts) if parts else "no changes"

    def to_dict(self) -> dict[str, Any]:
        def changes(items: tuple[tuple[str, tuple[Change, ...]], ...]) -> dict[str, list[dict[str, Any]]]:
            return {name: [{"path": format_path(c.path), "old": c.old, "new": c.new} for c in cs] for name, cs in items}
        return {
            "added": list(self.added), "removed": list(self.removed), "changed": changes(self.changed),
            "engines_added": list(self.engines_added), "engines_removed": list(self.engines_removed),
            "engines_changed": changes(self.engines_changed),
        }


def diff(old: Catalog, new: Catalog) -> CatalogDiff:
    old_models = {m.name: m.to_dict() for m in old.models}
    new_models = {m.name: m.to_dict() for m in new.models}
    old_engines = {n: e.to_dict() for n, e in old.engines.items() if not e.builtin}
    new_engines = {n: e.to_dict() for n, e in new.engines.items() if not e.builtin}
    return CatalogDiff(
        added=tuple(n for n in new_models if n not in old_models),
        removed=tuple(n for n in old_models if n not in new_models),
        changed=_changed(old_models, new_models),
        engines_added=tuple(n for n in new_engines if n not in old_engines),
        engines_removed=tuple(n for n in old_engines if n not in new_engines),
        engines_changed=_changed(old_engines, new_engines),
    )


def _changed(old: dict[str, Any], new: dict[str, Any]) -> tuple[tuple[str, tuple[Change, ...]], ...]:
    out = []
    for name, doc in new.items():
        if name in old and old[name] != doc:
            out.append((name, tuple(_fields(old[name], doc, ()))))
    return tuple(out)


def _fields(old: Any, new: Any, path: tuple[str | int, ...]) -> list[Change]:

    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in list(new) + [k for k in old if k not in new]:
            if old.get(key) != new.get(key):
                out.extend(_fields(old.get(key), new.get(key), path + (key,)))
        return out
    # Profiles are matched by name, not position, so inserting one profile in
    # front reads as one added profile rather than every profile changed.
    if _named_list(old) and _named_list(new):
        before = {p["name"]: p for p in old}
        after = {p["name"]: p for p in new}
        out = []
        for i, item in enumerate(new):
            if item["name"] not in before:
                out.append(Change(path + (i,), None, item))
            elif before[item["name"]] != item:
                out.extend(_fields(before[item["name"]], item, path + (i,)))
        out.extend(Change(path + (i,), item, None) for i, item in enumerate(old) if item["name"] not in after)
        if not out and old != new:
            out.append(Change(path, [p["name"] for p in old], [p["name"] for p in new]))  # reordered
        return out
    return [Change(path, old, new)]


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, dict) and "name" in x for x in value)


def _show(value: Any) -> str:
    """A value as it would be written in a catalog file: YAML's flow style on one line, not a Python repr.

    `[--max-model-len, '32768']` and `{VLLM_ATTENTION_BACKEND: FLASHINFER}`
    read as the file does; a string is quoted only where YAML needs it (a
    number-like '32768' stays quoted, so a type change shows).
    """
    if value is None:
        return "(absent)"
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True, sort_keys=False)
    return text.removesuffix("\n...\n").strip()
