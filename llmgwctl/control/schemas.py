"""The control API's payload schemas (schemas/api/*.json), checked where payloads come in.

A report that does not follow the agent protocol gets a 400 naming the path
and what was wrong, instead of half-updating the inventory.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsonschema.protocols import Validator  # jsonschema loads only when a payload is first checked


SCHEMAS = Path(__file__).resolve().parent.parent / "_data" / "schemas" / "api"


@cache
def validator(name: str) -> Validator:
    import jsonschema

    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    return jsonschema.validators.validator_for(schema)(schema)


# The schema keywords the fast check may see: the ones whose meaning is the
# same in draft 2020-12, which our schemas are written in and jsonschema
# applies, and in draft 7, which fastjsonschema compiles. A schema using any
# other (prefixItems, unevaluatedProperties, $dynamicRef, ...) gets no fast
# check, so the compiled one can never accept what jsonschema would refuse.
FAST_KEYWORDS = frozenset({"$id", "title", "description", "type", "properties", "required", "additionalProperties",
                           "items", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                           "minLength", "maxLength", "pattern", "minItems", "maxItems", "default", "examples",
                           "maxProperties", "propertyNames"})


def _keywords(schema: Any) -> set[str]:
    """Every keyword used anywhere in `schema` (property names are not keywords)."""
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            found.add(key)
            if key == "properties" and isinstance(value, dict):
                for sub in value.values():
                    found |= _keywords(sub)
            elif key not in ("enum", "const", "default", "examples", "required"):
                found |= _keywords(value)
    elif isinstance(schema, list):
        for sub in schema:
            found |= _keywords(sub)
    return found


@cache
def _fast(name: str) -> Callable[[Any], Any] | None:
    """Schema `name` compiled to Python (fastjsonschema), or None if it uses a keyword outside FAST_KEYWORDS."""
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    body = {k: v for k, v in schema.items() if k != "$schema"}
    if not _keywords(body) <= FAST_KEYWORDS:
        return None
    import fastjsonschema

    return fastjsonschema.compile(body)


def problems(name: str, document: Any, limit: int = 5) -> list[str]:
    """Up to `limit` problems of `document` against schema `name`, as `path: message`.

    A valid document is told so by the compiled check, several times faster
    than jsonschema, even remembering the items that passed, when one replica
    is new -- as in every report of a rollout (bench/README.md, "Figures
    behind the comments"); only one it refuses is checked again by
    jsonschema, whose problems (path, message) are the ones said.
    """
    fast = _fast(name)
    if fast is not None:
        try:
            fast(document)
            return []
        except Exception:  # noqa: BLE001 -- a refusal, or a document too odd to compile a check for: jsonschema says which
            pass
    return _problems(validator(name), document, limit)


def _problems(checker: Validator, document: Any, limit: int, prefix: tuple[str | int, ...] = ()) -> list[str]:

    out = []
    for error in checker.iter_errors(document):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in (*prefix, *error.absolute_path)).lstrip(".")
        out.append(f"{path or '(top level)'}: {error.message}")
        if len(out) >= limit:
            break
    return out
