"""The control API's payload schemas (schemas/api/*.json), checked where payloads come in.

A report that does not follow the agent protocol gets a 400 naming the path
and what was wrong, instead of half-updating the inventory.
"""
from __future__ import annotations

import hashlib
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


# Arrays of a schema whose items are checked one by one, each against its own
# part of the schema, and remembered when they pass: an agent's report is
# checked whole whenever it changed, yet most of it -- its GPUs, the replicas
# that did not change -- is what it sent last time. jsonschema took ~750 us
# for a report of 8 GPUs and 4 replicas, and during a rollout at 5,000 nodes
# thousands of changed reports a second queue on the loop with the passes
# (issue 19).
SPLIT = {"agent-report": ("gpus", "replicas")}
# Items remembered as valid, by a 16-byte digest of their JSON text (a
# replica's text, its spec included, is ~1 KB; 20,000 replicas in two states
# each kept as text were tens of MiB): a fleet's worth of replicas and GPU
# models; past it the memory starts again empty.
PASSED_ITEMS = 100_000
_passed: set[bytes] = set()


def problems(name: str, document: Any, limit: int = 5) -> list[str]:
    """Up to `limit` problems of `document` against schema `name`, as `path: message`."""
    arrays = SPLIT.get(name, ())
    if not arrays or not isinstance(document, dict) or not all(isinstance(document.get(k, []), list) for k in arrays):
        return _problems(validator(name), document, limit)
    # The document without those arrays' items, then each item (the array's own
    # keywords -- its type, a minimum length -- are still checked on the shell).
    # The shell is remembered too: it is the node's name, ids, pools and engines, the
    # same in every report of a node's life (a changed report changes its replicas).
    shell = {k: ([] if k in arrays else v) for k, v in document.items()}
    out = _checked(name, "", shell, validator(name), limit, ())
    for key in arrays:
        for i, item in enumerate(document.get(key, ())):
            if len(out) >= limit:
                return out
            out.extend(_checked(name, key, item, _item_validator(name, key), limit - len(out), (key, i)))
    return out


def _checked(name: str, key: str, part: Any, checker, limit: int, prefix: tuple) -> list[str]:
    """`part`'s problems, or none at once when the very same text passed before (see PASSED_ITEMS)."""
    text = f"{name}/{key}:" + json.dumps(part, sort_keys=True, default=repr)
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if digest in _passed:
        return []
    found = _problems(checker, part, limit, prefix=prefix)
    if not found:
        if len(_passed) >= PASSED_ITEMS:
            _passed.clear()
        _passed.add(digest)
    return found


@lru_cache(maxsize=None)
def _item_validator(name: str, key: str):
    import jsonschema

    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    items = dict(schema["properties"][key]["items"], **{"$schema": schema["$schema"]})
    return jsonschema.validators.validator_for(schema)(items)


def _problems(checker, document: Any, limit: int, prefix: tuple = ()) -> list[str]:
    out = []
    for error in checker.iter_errors(document):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in (*prefix, *error.absolute_path)).lstrip(".")
        out.append(f"{path or '(top level)'}: {error.message}")
        if len(out) >= limit:
            break
    return out
