"""The catalog's JSON Schema: checking a document against it, and saying what it refused and where.

Owns `schemas/catalog.schema.json` as the loader uses it -- refs inlined,
compiled to Python where it can be (fastjsonschema) with jsonschema's errors
as the ones reported -- the rewording of each error as what was expected,
and placing a problem at the line and column of its path (`locate`).
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

from .errors import EXCERPT, Problem, excerpt
from .yamldoc import DocPath, Finding, Positions


def schema_path() -> Path:
    """Where catalog.schema.json is: inside the package, which a wheel and an editable install both carry."""
    return Path(__file__).resolve().parent.parent / "_data" / "schemas" / "catalog.schema.json"


@lru_cache(maxsize=1)
def _validator() -> Validator:
    import jsonschema

    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    # Our schema has no recursion, so every local $ref can be replaced by what it
    # points at; resolving refs per instance was a third of validating a
    # 1,000-model catalog.
    return cls(_inline_refs(schema, schema.get("$defs", {})))


def _inline_refs(node: Any, defs: Mapping[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            merged = {**_inline_refs(defs[ref[len("#/$defs/"):]], defs),
                      **{k: _inline_refs(v, defs) for k, v in node.items() if k != "$ref"}}
            return merged
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({excerpt(value)})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} ({excerpt(value)})"


_JSON_TYPES = {"object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
               "number": "a number", "boolean": "true or false", "null": "null"}


def _json_type(name: str) -> str:
    """How a message names a JSON Schema type; a type this table lacks is named as the schema spells it."""
    return _JSON_TYPES.get(name, name)


@lru_cache(maxsize=1)
def models_per_file() -> int:
    """The schema's bound on one file's models (models.maxItems)."""
    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    return int(schema["properties"]["models"]["maxItems"])


@lru_cache(maxsize=1)
def _model_validator() -> Validator:
    """The schema of one `models` item, refs inlined as in `_validator`."""
    import jsonschema

    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    defs = schema.get("$defs", {})
    return jsonschema.validators.validator_for(schema)(dict(_inline_refs(defs["model"], defs),
                                                            **{"$schema": schema["$schema"]}))


@lru_cache(maxsize=1)
def _compiled() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The whole document's schema and one model item's, compiled to Python (fastjsonschema); None if it cannot be.

    jsonschema walking every model was a third to a half of a load. The
    compiled check says in a fraction of that whether a document is valid;
    only what it refuses is checked again by jsonschema, whose errors are the
    ones reported. Every keyword the catalog schema uses means the same in
    the draft 7 fastjsonschema compiles as in 2020-12, and refs are inlined
    (as for jsonschema); a refusal it alone makes (it is stricter about 1.0
    as an integer) only costs the jsonschema pass, never a wrong answer.
    """
    try:
        import fastjsonschema
    except ImportError:  # pragma: no cover -- a dependency; without it jsonschema does it all
        return None
    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    defs = schema.get("$defs", {})
    body = {k: v for k, v in _inline_refs(schema, defs).items() if k not in ("$schema", "$id", "$defs")}
    item = _inline_refs(defs["model"], defs)
    return fastjsonschema.compile(body), fastjsonschema.compile(item)


def _passes(check: Callable[[Any], Any] | None, value: Any) -> bool:
    if check is None:
        return False
    try:
        check(value)
        return True
    except Exception:  # noqa: BLE001 -- a refusal, or a value too odd for the compiled check: jsonschema says which
        return False


def schema_errors(document: dict[str, Any]) -> list[Finding]:
    compiled = _compiled()
    if compiled is not None and _passes(compiled[0], document):
        return []
    model_check = compiled[1] if compiled is not None else None
    out: list[Finding] = []
    models = document.get("models")
    if not isinstance(models, list) or not models:
        for error in _validator().iter_errors(document):
            out.extend(_explain(error))
    else:
        # The document without its models' items, then each item: in the order the
        # whole document's check gives (models come before `engines` in the schema).
        shell = [x for e in _validator().iter_errors(dict(document, models=[])) for x in _explain(e)]
        out.extend(x for x in shell if x[0][:1] != ("engines",))
        for i, item in enumerate(models):
            if _passes(model_check, item):
                continue
            out.extend((("models", i) + path, msg) for e in _model_validator().iter_errors(item)
                       for path, msg in _explain(e))
        out.extend(x for x in shell if x[0][:1] == ("engines",))
    # Once each: jsonschema raises one `required` error per missing field,
    # and each is explained as every field that mapping lacks.
    return list(dict.fromkeys(out))


def _explain(error: ValidationError) -> list[Finding]:
    """jsonschema's errors, reworded as what was expected and where."""
    path: DocPath = tuple(error.absolute_path)
    # The stubs type these as "or unset" for errors built by hand; jsonschema's own always carry them.
    v: Any = error.validator
    inst: Any = error.instance
    value: Any = error.validator_value
    schema: Mapping[str, Any] = error.schema if isinstance(error.schema, Mapping) else {}
    if v in ("oneOf", "anyOf"):
        # Errors from the branch whose type matched say what is really wrong
        # ("min: -1 is less than 0"); if no branch's type matched, say which
        # types would have.
        deeper = [e for e in error.context if e.validator != "type"]
        if deeper:
            return [x for e in deeper for x in _explain(e)]
        types = [_json_type(str(t)) for e in error.context if e.validator == "type"
                 for t in (e.validator_value if isinstance(e.validator_value, list) else [e.validator_value])]
        return [(path, f"expected {' or '.join(dict.fromkeys(types))}, got {kind(inst)}")]
    if v == "type":
        wanted = value if isinstance(value, list) else [value]
        msg = f"expected {' or '.join(_json_type(str(t)) for t in wanted)}, got {kind(inst)}"
        if "string" in wanted and isinstance(inst, (bool, int, float, type(None))) or hasattr(inst, "isoformat"):
            msg += "; quote it to make it a string"
        return [(path, msg)]
    if v == "required":
        missing = [k for k in value if k not in inst]
        return [(path, f"missing required field {k!r}") for k in missing]
    if v == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = [k for k in inst if k not in schema.get("properties", {})]
        out: list[Finding] = []
        for key in extra:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(allowed)}"
            out.append((path + (key,), f"unknown field {excerpt(key)}; {hint}"))
        return out
    if v == "const":
        return [(path, f"expected {value!r}, got {kind(inst)}")]
    if v == "pattern":
        what = schema.get("description") or f"a value matching {value}"
        return [(path, f"{excerpt(inst)} is not allowed here: expected {what[0].lower() + what[1:] if what else what}".rstrip(".")
                 + f" (pattern {value})")]
    if v == "propertyNames":
        return [(path + (inst,) if isinstance(inst, str) else path, _short_message(error))]
    if v == "minItems":
        return [(path, f"needs at least {value} item{'s' if value != 1 else ''}")]
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {"minimum": "at least", "maximum": "at most", "exclusiveMinimum": "greater than", "exclusiveMaximum": "less than"}
        return [(path, f"expected a number {words[v]} {value}, got {excerpt(inst)}")]
    if v == "minLength":
        return [(path, "must not be empty")]
    if v == "maxLength":
        return [(path, f"is longer than {value} characters")]
    if v == "maxItems":
        return [(path, f"has more than {value} items, the most allowed here")]
    if v == "maxProperties":
        return [(path, f"has more than {value} entries, the most allowed here")]
    return [(path, _short_message(error))]


def _short_message(error: ValidationError) -> str:
    # jsonschema's own messages start with the instance's repr, which may be a
    # whole mapping of the file: say what is wrong without it.
    message = str(error.message)
    text = repr(error.instance)
    return message.replace(text, excerpt(error.instance)) if len(text) > EXCERPT else message


def locate(problem: Problem, positions: Positions | None) -> Problem:
    """Give a problem the line and column of the deepest part of its path the file has.

    `positions` None: a document that came without text (`loader.load_document`),
    which has no lines to point at; the problem keeps its path alone.
    """
    if positions is None:
        return problem
    path = tuple(problem.path)
    while path and path not in positions:
        path = path[:-1]
    line, col = positions.get(path, (1, 1))
    return Problem(problem.file, problem.path, problem.message, line, col)
