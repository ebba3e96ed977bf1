"""The control API's payload schemas (schemas/api/*.json), checked where payloads come in.

A report that does not follow the agent protocol gets a 400 naming the path
and what was wrong, instead of half-updating the inventory.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parent.parent / "_data" / "schemas" / "api"


@lru_cache(maxsize=None)
def validator(name: str):
    import jsonschema

    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    return jsonschema.validators.validator_for(schema)(schema)


def problems(name: str, document: Any, limit: int = 5) -> list[str]:
    """Up to `limit` problems of `document` against schema `name`, as `path: message`."""
    out = []
    for error in validator(name).iter_errors(document):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        out.append(f"{path or '(top level)'}: {error.message}")
        if len(out) >= limit:
            break
    return out
