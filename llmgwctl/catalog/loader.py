"""Loading a catalog: files, directories, a document's text or a parsed document, into one valid `Catalog`.

The entry points, and assembling what each file contributes into one
catalog. Every problem in every file is collected before anything is
raised, and each one carries the file, line and column it is about, so
`catalog validate` and the watcher's rejection name all of them at once in
`file:line:col: path: msg` form. A document that came already parsed (the
catalog a controller's watch sends, `load_document`) has no lines: its
problems name where it came from and the path inside it.

A load is a pipeline, one module a step:

    files      which files, read within bounds; FileCache for reloads
    yamldoc    bytes -> document, with every value's line and column
    documents  document -> models and engines (schema, then field rules)
    schema     the JSON Schema check and its errors, reworded and located
    limits     what a load may cost (Limits), its deadline, the paused collector

and here the whole-catalog rules (`Catalog`'s constructor) run over the
union of the files.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .documents import FileResult, check, measure_document
from .errors import EXCERPT, CatalogError, Problem, excerpt, format_path
from .files import RACY_NS, SUFFIXES, TRUST_STAT_FOR, FileCache, catalog_files, is_catalog_file, read, read_file
from .limits import DEFAULT_LIMITS, NO_DEADLINE, Deadline, Limits, collector_paused, mib, too_big
from .model import Catalog, EngineSpec, Model
from .schema import locate, models_per_file, schema_path
from .yamldoc import DocPath, Parsed, Positions, measure, parse

# The longest message one problem carries, whatever produced it.
MAX_MESSAGE = 300


def load_dir(directory: str | os.PathLike[str], cache: FileCache | None = None, *,
             limits: Limits = DEFAULT_LIMITS, replace: Mapping[str, bytes] | None = None) -> Catalog:
    """The catalog a directory holds; CatalogError with every problem if it is not valid.

    `replace` maps a file name to the content it would have (what `catalog
    apply` checks before writing), so nothing is copied to validate an edit.
    """
    return load_paths([directory], cache=cache, limits=limits, replace=replace)


def load_paths(paths: Sequence[str | os.PathLike[str]], cache: FileCache | None = None, *,
               limits: Limits = DEFAULT_LIMITS, replace: Mapping[str, bytes] | None = None) -> Catalog:
    """One catalog from files and directories together (their union, as a directory's files are)."""
    files: list[tuple[str, str | None]] = []   # (path, the directory its links must stay in, or None)
    problems: list[Problem] = []
    replace = dict(replace or {})
    for path in paths:
        path = os.fspath(path)
        if os.path.isdir(path):
            real = os.path.realpath(path)
            names = {os.path.basename(f) for f in catalog_files(path)}
            listed = [os.path.normpath(os.path.join(path, n)) for n in sorted(names | set(replace))]
            if not listed:
                # Like an empty file: a directory whose files were all removed
                # (a bad `git rm`, a half-done sync) must not tear down every model.
                problems.append(Problem(path, (), "holds no *.yaml or *.yml catalog file: write one, or point "
                                                  "llmgw at the directory that holds them"))
            files.extend((f, real) for f in listed)
        elif os.path.exists(path):
            files.append((path, None))
        elif os.path.islink(path):
            problems.append(Problem(path, (), f"broken symlink to {excerpt(os.readlink(path), 200)}"))
        else:
            problems.append(Problem(path, (), "no such file or directory"))
    results = []
    total_bytes = total_nodes = total_models = 0
    deadline = Deadline(limits.max_seconds)
    with collector_paused():
        for file, root in files:
            if deadline.passed():
                problems.append(Problem(file, (), deadline.message()))
                break
            name = os.path.basename(file)
            result: FileResult | None = None
            if root is not None and name in replace:
                data: bytes | Problem | None = replace[name]
                size, key = len(replace[name]), None
            else:
                got = read(file, root, limits.max_file_bytes, cache)
                if isinstance(got, Problem):
                    problems.append(got)
                    continue
                data, key, size, result = got
            if isinstance(data, Problem):   # (only for mypy: _read returned it above)
                problems.append(data)
                continue
            if size > limits.max_file_bytes:
                problems.append(Problem(file, (), too_big(size, limits.max_file_bytes, "file")))
                continue
            total_bytes += size
            if total_bytes > limits.max_dir_bytes:
                problems.append(Problem(file, (), f"the catalog's files add up to more than "
                                                  f"{mib(limits.max_dir_bytes)} with this one; not read"))
                break
            if result is None:
                assert data is not None
                digest = hashlib.sha256(data).hexdigest()
                result = cache.get(file, digest) if cache else None
                if result is None:
                    result = _load_file(file, data, limits, deadline=deadline)
                    if cache:
                        cache.parses += 1
                if cache and not deadline.hit:
                    cache.put(file, digest, result, key)
            total_nodes += result.nodes
            if total_nodes > limits.max_nodes and not result.problems:
                problems.append(Problem(file, (), f"the catalog's files hold more than {limits.max_nodes} YAML nodes "
                                                  "together with this one; split the catalog or raise the limit"))
                break
            total_models += len(result.models)
            if total_models > limits.max_models:
                problems.append(Problem(file, (), f"the catalog's files hold more than {limits.max_models} models "
                                                  "together with this one, the most one catalog may hold"))
                break
            results.append((file, result))
        if cache:
            cache.keep_only(f for f, _ in files)
        return _assemble(results, problems)


def load_text(text: str | bytes, file: str = "<input>", *, limits: Limits = DEFAULT_LIMITS) -> Catalog:
    """A catalog from one document's text (what `POST /api/v1/catalog` receives)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if len(data) > limits.max_file_bytes:
        raise CatalogError([Problem(file, (), too_big(len(data), limits.max_file_bytes, "document"))])
    with collector_paused():
        return _assemble([(file, _load_file(file, data, limits, limits.max_nodes,
                                            deadline=Deadline(limits.max_seconds)))], [])


def load_document(document: Any, source: str = "<document>", *, limits: Limits = DEFAULT_LIMITS) -> Catalog:
    """A catalog from a document already parsed (a controller's watch answer, `Catalog.to_dict()`'s form).

    The checks a file gets, but for the text: the same schema, the same field
    and whole-catalog rules, the same node, depth and model limits, with the
    same messages. Problems name `source` and the path inside the document,
    never a line: it came without text.
    """
    nodes, found, refused = measure_document(document, limits.max_depth)
    with collector_paused():
        if refused is not None:
            result = FileResult(problems=(Problem(source, (), refused),), positions=None, nodes=nodes)
        elif nodes > limits.max_nodes:
            result = FileResult(problems=(Problem(source, (), f"holds more than {limits.max_nodes} values; "
                                                              "a catalog to split"),), positions=None, nodes=nodes)
        else:
            result = check(source, document, None, found, nodes, Deadline(limits.max_seconds))
        return _assemble([(source, result)], [])


def _assemble(results: list[tuple[str, FileResult]], problems: list[Problem]) -> Catalog:
    models: list[Model] = []
    engines: dict[str, EngineSpec] = {}
    positions: dict[str, Positions | None] = {}
    broken: set[tuple[str, DocPath]] = set()
    for file, result in results:
        problems.extend(result.problems)
        models.extend(result.models)
        broken.update((file, p.path) for p in result.problems)
        positions[file] = result.positions
        for spec in result.engines:
            if spec.name in engines:
                first = engines[spec.name].origin.file
                problems.append(locate(Problem(file, spec.origin.path, f"engine {spec.name!r} is already defined in {first}"),
                                       result.positions))
                continue
            engines[spec.name] = spec
    try:
        catalog = Catalog(models, engines)
    except CatalogError as exc:
        # Rules run on models the schema found broken too (built leniently, see
        # _lenient_model), so a file's problems come in one round; what those
        # rules say at a spot the schema already reported adds nothing.
        problems.extend(locate(p, positions.get(p.file, {})) for p in exc.problems
                        if not _under_reported(p, broken))
        catalog = None
    if problems or catalog is None:
        raise CatalogError(_clamped(p) for p in problems)
    return catalog


def _under_reported(problem: Problem, broken: set[tuple[str, DocPath]]) -> bool:
    path = tuple(problem.path)
    return any((problem.file, path[:n]) in broken for n in range(3, len(path) + 1))


def _clamped(problem: Problem) -> Problem:
    # The last guard of "a rejection never prints a file": whatever a rule or a
    # library wrote, one problem's message stays a line long.
    if len(problem.message) <= MAX_MESSAGE:
        return problem
    return Problem(problem.file, problem.path, problem.message[:MAX_MESSAGE] + "...", problem.line, problem.column)


# --- one file ---------------------------------------------------------------

def _load_file(file: str, data: bytes, limits: Limits = DEFAULT_LIMITS, node_budget: int | None = None, *,
               deadline: Deadline = NO_DEADLINE) -> FileResult:
    parsed = parse(file, data, limits, limits.max_nodes if node_budget is None else node_budget, deadline)
    if not isinstance(parsed, Parsed):
        return FileResult(problems=(parsed.problem,), positions=parsed.positions, nodes=parsed.nodes)
    return check(file, parsed.document, parsed.positions, parsed.found, parsed.nodes, deadline)


# The names this module has always offered; their homes are the modules above.
_measure, _models_per_file = measure, models_per_file

__all__ = ["DEFAULT_LIMITS", "EXCERPT", "RACY_NS", "SUFFIXES", "TRUST_STAT_FOR", "FileCache", "Limits",
           "catalog_files", "excerpt", "format_path", "is_catalog_file", "load_dir", "load_document", "load_paths",
           "load_text", "read_file", "schema_path"]
