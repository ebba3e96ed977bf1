"""Reading catalog files: YAML with positions, JSON Schema, then the catalog's own rules.

Every problem in every file is collected before anything is raised, and each
one carries the file, line and column it is about, so `catalog validate` and
the watcher's rejection name all of them at once in `file:line:col: path: msg`
form.

Which files count: `*.yaml` and `*.yml` directly in the directory, following
symlinks (Kubernetes ConfigMap mounts are symlinks into a hidden `..data`
directory). Hidden names (`.#x.yaml` emacs locks, `.x.yaml.swp` vim swaps) and
names starting with `#` (emacs autosaves) are editors' scratch files and are
never read; `x.yaml~` backups and `x.yaml.tmp` (what `catalog apply` writes
before its rename) fail the suffix test. Subdirectories are not descended into,
so operators can keep drafts or archives beside the catalog.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import yaml

from .durations import parse_duration
from .errors import CatalogError, Problem, format_path
from .model import Catalog, EngineSpec, Model, Origin, Profile, Replicas

SUFFIXES = (".yaml", ".yml")
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: ~10x faster on big catalogs

def schema_path() -> Path:
    """Where catalog.schema.json is: inside the package, which a wheel and an editable install both carry."""
    return Path(__file__).resolve().parent.parent / "_data" / "schemas" / "catalog.schema.json"


@lru_cache(maxsize=1)
def _validator():
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


def is_catalog_file(name: str) -> bool:
    return name.endswith(SUFFIXES) and not name.startswith((".", "#"))


def catalog_files(directory: str | os.PathLike) -> list[str]:
    """The files of a catalog directory, sorted so errors and merges come in a stable order."""
    with os.scandir(directory) as entries:
        return sorted(os.path.normpath(os.path.join(directory, e.name)) for e in entries if is_catalog_file(e.name))


@dataclass(frozen=True)
class _FileResult:
    """What one file contributes: its models and engines if it was valid, else its problems."""

    models: tuple[Model, ...] = ()
    engines: tuple[EngineSpec, ...] = ()
    problems: tuple[Problem, ...] = ()
    positions: Mapping[tuple, tuple[int, int]] = field(default_factory=dict)


class FileCache:
    """Parsed files by path and content digest, so a watcher's reload re-parses only what changed.

    A `git pull` that touches one file of a 1,000-model directory then costs one
    file's parse plus the cross-file checks, not the whole directory's.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, _FileResult]] = {}

    def get(self, path: str, digest: str) -> _FileResult | None:
        hit = self._entries.get(path)
        return hit[1] if hit and hit[0] == digest else None

    def put(self, path: str, digest: str, result: _FileResult) -> None:
        self._entries[path] = (digest, result)

    def keep_only(self, paths: Iterable[str]) -> None:
        keep = set(paths)
        for path in [p for p in self._entries if p not in keep]:
            del self._entries[path]


def load_dir(directory: str | os.PathLike, cache: FileCache | None = None) -> Catalog:
    """The catalog a directory holds; CatalogError with every problem if it is not valid."""
    return load_paths([directory], cache=cache)


def load_paths(paths: Sequence[str | os.PathLike], cache: FileCache | None = None) -> Catalog:
    """One catalog from files and directories together (their union, as a directory's files are)."""
    files: list[str] = []
    problems: list[Problem] = []
    for path in paths:
        path = os.fspath(path)
        if os.path.isdir(path):
            files.extend(catalog_files(path))
        elif os.path.exists(path):
            files.append(path)
        elif os.path.islink(path):
            problems.append(Problem(path, (), f"broken symlink to {os.readlink(path)!r}"))
        else:
            problems.append(Problem(path, (), "no such file or directory"))
    results = []
    for file in files:
        try:
            data = Path(file).read_bytes()
        except FileNotFoundError:
            # A dangling symlink, or a file deleted between listing and reading (an
            # editor's rename dance); the watcher reloads again on the next event.
            target = f" to {os.readlink(file)!r}" if os.path.islink(file) else ""
            problems.append(Problem(file, (), f"broken symlink{target}" if target else "file disappeared while reading"))
            continue
        except IsADirectoryError:
            problems.append(Problem(file, (), "is a directory, not a catalog file"))
            continue
        except OSError as exc:
            problems.append(Problem(file, (), f"cannot read: {exc.strerror or exc}"))
            continue
        digest = hashlib.sha256(data).hexdigest()
        result = cache.get(file, digest) if cache else None
        if result is None:
            result = _load_file(file, data)
            if cache:
                cache.put(file, digest, result)
        results.append((file, result))
    if cache:
        cache.keep_only(files)
    return _assemble(results, problems)


def load_text(text: str | bytes, file: str = "<input>") -> Catalog:
    """A catalog from one document's text (what `POST /api/v1/catalog` receives)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return _assemble([(file, _load_file(file, data))], [])


def _assemble(results: list[tuple[str, _FileResult]], problems: list[Problem]) -> Catalog:
    models: list[Model] = []
    engines: dict[str, EngineSpec] = {}
    positions: dict[str, Mapping[tuple, tuple[int, int]]] = {}
    for file, result in results:
        problems.extend(result.problems)
        models.extend(result.models)
        positions[file] = result.positions
        for spec in result.engines:
            if spec.name in engines:
                first = engines[spec.name].origin.file
                problems.append(_locate(Problem(file, spec.origin.path, f"engine {spec.name!r} is already defined in {first}"),
                                        result.positions))
                continue
            engines[spec.name] = spec
    try:
        catalog = Catalog(models, engines)
    except CatalogError as exc:
        problems.extend(_locate(p, positions.get(p.file, {})) for p in exc.problems)
        catalog = None
    if problems:
        raise CatalogError(problems)
    return catalog


def _locate(problem: Problem, positions: Mapping[tuple, tuple[int, int]]) -> Problem:
    """Give a problem the line and column of the deepest part of its path the file has."""
    path = tuple(problem.path)
    while path and path not in positions:
        path = path[:-1]
    line, col = positions.get(path, (1, 1))
    return Problem(problem.file, problem.path, problem.message, line, col)


# --- one file ---------------------------------------------------------------

def _load_file(file: str, data: bytes) -> _FileResult:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return _FileResult(problems=(Problem(file, (), f"not UTF-8: byte 0x{data[exc.start]:02x} cannot be decoded; save the file as UTF-8", line, col),))
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                # An empty file is rejected, not read as "no models": a file
                # truncated by a crashed editor or a half-done `> file` must not
                # tear down every model it used to define.
                return _FileResult(problems=(Problem(file, (), "file is empty: write a Catalog document (apiVersion: llmgw/v1, kind: Catalog) or delete the file", 1, 1),))
            positions: dict[tuple, tuple[int, int]] = {}
            dup = _walk(node, (), positions)
            document = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = str(exc.problem or exc.context)
        if exc.context and exc.problem and exc.context_mark:
            message += f" ({exc.context} started at line {exc.context_mark.line + 1})"
        if "expected a single document" in message:
            message = "holds more than one YAML document (---); put one Catalog per file"
        return _FileResult(problems=(Problem(file, (), f"invalid YAML: {message}", mark.line + 1 if mark else 0, mark.column + 1 if mark else 0),))
    except yaml.YAMLError as exc:
        return _FileResult(problems=(Problem(file, (), f"invalid YAML: {exc}"),))
    if dup:
        return _FileResult(problems=tuple(Problem(file, path, msg, *positions.get(path, (0, 0))) for path, msg in dup), positions=positions)
    if not isinstance(document, dict):
        return _FileResult(problems=(Problem(file, (), f"expected a mapping with apiVersion: llmgw/v1 and kind: Catalog, got {_kind(document)}", 1, 1),), positions=positions)
    errors = _schema_errors(document)
    problems = [_locate(Problem(file, path, msg), positions) for path, msg in errors]
    # Models and engines the schema found nothing wrong with are still built and
    # checked, so one run reports a typo in one model *and* a duplicate name in
    # another instead of making the operator fix them one round trip at a time.
    broken = {path[:2] for path, _ in errors if len(path) >= 2}
    whole_broken = {path[:1] for path, _ in errors if len(path) < 2}
    models, engines = [], []
    if ("models",) not in whole_broken:
        for i, raw in enumerate(document.get("models") or ()):
            if ("models", i) in broken:
                continue
            try:
                models.append(_model(raw, Origin(file, ("models", i))))
            except _FieldError as exc:
                problems.append(_locate(Problem(file, ("models", i) + exc.path, exc.message), positions))
    if ("engines",) not in whole_broken:
        for name, raw in (document.get("engines") or {}).items():
            if ("engines", name) in broken:
                continue
            engines.append(EngineSpec(
                name=name, command=tuple(raw["command"]), health=raw.get("health", "/health"),
                metrics=raw.get("metrics"), origin=Origin(file, ("engines", name)),
            ))
    return _FileResult(tuple(models), tuple(engines), tuple(problems), positions)


def _walk(node: yaml.Node, path: tuple, positions: dict) -> list[tuple[tuple, str]]:
    """Record where every value starts; return duplicate keys, which PyYAML would silently merge."""
    positions[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    dup: list[tuple[tuple, str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
            if key in seen:
                positions[path + (key,)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                dup.append((path + (key,), f"key {key!r} appears twice in the same mapping; only one can count"))
                continue
            seen.add(key)
            dup.extend(_walk(value_node, path + (key,), positions))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            dup.extend(_walk(item, path + (i,), positions))
    return dup


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} ({value})"


_JSON_TYPES = {"object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
               "number": "a number", "boolean": "true or false", "null": "null"}


def _schema_errors(document: dict) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    for error in _validator().iter_errors(document):
        out.extend(_explain(error))
    return out


def _explain(error) -> list[tuple[tuple, str]]:
    """jsonschema's errors, reworded as what was expected and where."""
    path = tuple(error.absolute_path)
    v, inst = error.validator, error.instance
    if v in ("oneOf", "anyOf"):
        # Errors from the branch whose type matched say what is really wrong
        # ("min: -1 is less than 0"); if no branch's type matched, say which
        # types would have.
        deeper = [e for e in error.context if e.validator != "type"]
        if deeper:
            return [x for e in deeper for x in _explain(e)]
        types = [_JSON_TYPES.get(t, t) for e in error.context if e.validator == "type"
                 for t in (e.validator_value if isinstance(e.validator_value, list) else [e.validator_value])]
        return [(path, f"expected {' or '.join(dict.fromkeys(types))}, got {_kind(inst)}")]
    if v == "type":
        wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        msg = f"expected {' or '.join(_JSON_TYPES.get(t, t) for t in wanted)}, got {_kind(inst)}"
        if "string" in wanted and isinstance(inst, (bool, int, float, type(None))) or hasattr(inst, "isoformat"):
            msg += "; quote it to make it a string"
        return [(path, msg)]
    if v == "required":
        missing = [k for k in error.validator_value if k not in inst]
        return [(path, f"missing required field {k!r}") for k in missing]
    if v == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = [k for k in inst if k not in error.schema.get("properties", {})]
        out = []
        for key in extra:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(allowed)}"
            out.append((path + (key,), f"unknown field {key!r}; {hint}"))
        return out
    if v == "const":
        return [(path, f"expected {error.validator_value!r}, got {_kind(inst)}")]
    if v == "pattern":
        what = error.schema.get("description") or f"a value matching {error.validator_value}"
        return [(path, f"{inst!r} is not allowed here: expected {what[0].lower() + what[1:] if what else what}".rstrip(".")
                 + f" (pattern {error.validator_value})")]
    if v == "propertyNames":
        return [(path + (inst,) if isinstance(inst, str) else path, f"{error.message}")]
    if v == "minItems":
        return [(path, f"needs at least {error.validator_value} item{'s' if error.validator_value != 1 else ''}")]
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {"minimum": "at least", "maximum": "at most", "exclusiveMinimum": "greater than", "exclusiveMaximum": "less than"}
        return [(path, f"expected a number {words[v]} {error.validator_value}, got {inst}")]
    if v == "minLength":
        return [(path, "must not be empty")]
    return [(path, error.message)]


# --- documents into models --------------------------------------------------

class _FieldError(Exception):
    def __init__(self, path: tuple, message: str):
        self.path, self.message = path, message


def _model(raw: Mapping[str, Any], origin: Origin) -> Model:
    replicas = raw.get("replicas", 1)
    if isinstance(replicas, dict):
        replicas = Replicas(replicas["min"], replicas["max"])
    else:
        replicas = Replicas(replicas, replicas)
    idle = raw.get("idle_timeout")
    if idle is not None:
        try:
            idle = parse_duration(idle)
        except ValueError as exc:
            raise _FieldError(("idle_timeout",), str(exc)) from None
    profiles = tuple(_profile(p) for p in raw["profiles"])
    return Model(
        name=raw["name"], profiles=profiles, source=raw.get("source") or raw["name"],
        aliases=tuple(raw.get("aliases") or ()), replicas=replicas, idle_timeout=idle, origin=origin,
    )


def _profile(raw: Mapping[str, Any]) -> Profile:
    return Profile(
        name=raw.get("name") or raw["engine"], engine=raw["engine"], pool=raw.get("pool"), source=raw.get("source"),
        gpus=raw.get("gpus", 1), priority=raw.get("priority", 0), weight=float(raw.get("weight", 1.0)),
        args=tuple(_scalar(a) for a in raw.get("args") or ()),
        env=MappingProxyType({k: _scalar(v) for k, v in (raw.get("env") or {}).items()}),
    )


def _scalar(value: Any) -> str:
    # YAML reads `- 32768` args and `FOO: 1` env values as numbers; the engine
    # sees text either way, so accept both rather than make operators quote them.
    return str(value)


__all__ = ["FileCache", "catalog_files", "is_catalog_file", "load_dir", "load_paths", "load_text", "schema_path", "format_path"]
