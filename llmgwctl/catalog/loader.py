"""Reading catalog files: YAML with positions, JSON Schema, then the catalog's own rules.

Every problem in every file is collected before anything is raised, and each
one carries the file, line and column it is about, so `catalog validate` and
the watcher's rejection name all of them at once in `file:line:col: path: msg`
form.

Which files count: `*.yaml` and `*.yml` directly in the directory, following
symlinks only while they stay inside it (Kubernetes ConfigMap mounts are
symlinks into a hidden `..data` directory; a link to /etc/passwd or a token
file is refused unread). Only regular files are read (a FIFO would block the
read for ever, /dev/zero never end it), each up to a size cap, the directory up
to another, and YAML aliases count at their expanded size against a node
budget (a 1 KB alias bomb expands to billions of nodes). See `Limits`.

Hidden names (`.#x.yaml` emacs locks, `.x.yaml.swp` vim swaps) and names
starting with `#` (emacs autosaves) are editors' scratch files and are never
read; `x.yaml~` backups and `x.yaml.tmp` (what `catalog apply` writes
before its rename) fail the suffix test. Subdirectories are not descended into,
so operators can keep drafts or archives beside the catalog.
"""
from __future__ import annotations

import contextlib
import difflib
import gc
import hashlib
import json
import math
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import yaml

from ..fsutil import OPEN_FLAGS, file_kind, read_upto
from ..yamlkit import LOADER, NodeCount
from .durations import parse_duration
from .sizes import parse_size_mib
from .errors import CatalogError, Problem, format_path
from .model import CONTINUATION_ATTEMPTS, Autoscale, Catalog, EngineSpec, Model, Origin, Profile, Replicas

SUFFIXES = (".yaml", ".yml")
_CONSTRUCTOR = yaml.constructor.SafeConstructor()        # only to read floats' values while walking nodes

# How much of a line or value a message may quote. An error must let the
# operator find the spot, and must never print a file (a secret in the wrong
# place, a link to a token) into status and logs.
EXCERPT = 40
# The longest message one problem carries, whatever produced it.
MAX_MESSAGE = 300


@dataclass(frozen=True, slots=True)
class Limits:
    """What one load may cost; the defaults hold real catalogs with room to spare.

    Validating costs per YAML node (composing, the schema, building models
    and the whole-catalog rules are all in Python), and a load's worst case is
    what its node budget allows: the defaults are set so that the costliest
    shape within them (tens of thousands of one-line models) validates in a
    few seconds on a 2-core machine, `bench/catalog_limits.py` measures each
    shape and bench/README.md has its figures. A real model is 30-50 nodes, so
    the budget is ~5,000 of them in one catalog, past any fleet one gateway
    serves; a bigger catalog is split across gateways, not loaded in one.
    """

    # A file's bytes bound the read and the scan before anything parses; 2 MiB
    # holds more than the node budget does in real models (~260 bytes for ~40
    # nodes), so a file never meets this before its nodes, unless it is
    # mostly comments or one huge string.
    max_file_bytes: int = 2 << 20
    # Four files at the cap; what the directory's bytes cost beyond its nodes
    # (reading, decoding, scanning) stays well under a second.
    max_dir_bytes: int = 8 << 20
    # YAML nodes per load (directory-wide), each alias counted at the size of
    # what it repeats, so an alias bomb is refused before it is expanded.
    max_nodes: int = 200_000
    # Models in the whole catalog. A model costs more than its nodes (it is
    # built, checked, hashed into the version, and placement and every
    # reconcile pass walk it), so one-line models would make the node budget
    # 25,000 of them; 10,000 is still past any fleet one gateway serves.
    max_models: int = 10_000
    # A catalog is 6 levels deep (models[i].profiles[j].env.KEY); libyaml's
    # composer recurses on the C stack and segfaults near 100,000 levels.
    max_depth: int = 64
    # The last guard, for a machine too loaded for the limits above to mean
    # anything: a load gives up after this long and says so, rather than
    # keep a thread working on the interpreter the router shares. Below the
    # watcher's LOAD_TIMEOUT (30 s), so the loader stops first, with its own reason.
    max_seconds: float | None = 25.0


DEFAULT_LIMITS = Limits()
# What PyYAML's reader refuses; found first by us, so the problem has a line:col.
_NON_PRINTABLE = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010ffff]")
_CONTROL_NAMES = {0: "NUL", 0x1b: "ESC", 0x7f: "DEL"}


def excerpt(value: Any, limit: int = EXCERPT) -> str:
    """`repr(value)`, cut to a short excerpt: what errors may quote of a file."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

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


def catalog_files(directory: str | os.PathLike[str]) -> list[str]:
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
    nodes: int = 0                  # YAML nodes, aliases expanded: what it costs against Limits.max_nodes


# A file whose stat says it was modified less than this before it was read may
# still change without its stat changing: the kernel stamps mtime from a
# coarse clock (one tick, 1-10 ms), FAT keeps 2 s, and two same-size writes
# within one stamp look alike (git's "racy" entries). Such a file is read and
# hashed again on every load until it is older than this; then its stat alone
# says it did not change.
RACY_NS = 3_000_000_000
# However long a stat keeps matching, a file is read again after this long:
# a filesystem whose clock lags ours (NFS) or a tool that restores mtime and
# size (rsync -t, `touch -r`) could otherwise keep a changed file unread;
# this bounds how long, at the cost of one read per file in that time.
TRUST_STAT_FOR = 300.0


@dataclass(slots=True)
class _Entry:
    key: tuple[int, ...] | None     # (dev, ino, size, mtime_ns, ctime_ns) of what was read; None: never by stat
    digest: str
    result: _FileResult
    trusted_until: float            # monotonic: past it, the file is read again whatever its stat says


class FileCache:
    """Parsed files by path, so a watcher's reload reads and parses only what changed.

    A file whose stat (device, inode, size, mtime and ctime in ns) is the one
    it had when it was read, and that was not racy then (see RACY_NS), is not
    read again: a `git pull` touching one file of 10,000 costs one read, one
    parse and the whole-catalog checks over the union, not 10,000 reads. A
    file that was read again but whose content digest is the same (a `touch`,
    a checkout rewriting it unchanged) is not parsed again. `reads` and
    `parses` count both (and `unchanged` the files taken by their stat), so a test can see what a reload read.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: dict[str, _Entry] = {}
        self._clock = clock
        self.reads = 0          # files opened and read
        self.parses = 0         # files parsed and checked (a read whose digest was new)
        self.unchanged = 0      # files taken by their stat alone

    def by_stat(self, path: str, key: tuple[int, ...]) -> _FileResult | None:
        """The cached result of `path` if its stat is still `key` and may be trusted."""
        entry = self._entries.get(path)
        if entry is None or entry.key != key or self._clock() >= entry.trusted_until:
            return None
        self.unchanged += 1
        return entry.result

    def get(self, path: str, digest: str) -> _FileResult | None:
        entry = self._entries.get(path)
        return entry.result if entry and entry.digest == digest else None

    def put(self, path: str, digest: str, result: _FileResult, key: tuple[int, ...] | None = None) -> None:
        self._entries[path] = _Entry(key, digest, result, self._clock() + TRUST_STAT_FOR)

    def keep_only(self, paths: Iterable[str]) -> None:
        keep = set(paths)
        for path in [p for p in self._entries if p not in keep]:
            del self._entries[path]


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
    deadline = _Deadline(limits.max_seconds)
    with _collector_paused():
        for file, root in files:
            if deadline.passed():
                problems.append(Problem(file, (), deadline.message()))
                break
            name = os.path.basename(file)
            result: _FileResult | None = None
            if root is not None and name in replace:
                data: bytes | Problem | None = replace[name]
                size, key = len(replace[name]), None
            else:
                got = _read(file, root, limits.max_file_bytes, cache)
                if isinstance(got, Problem):
                    problems.append(got)
                    continue
                data, key, size, result = got
            if isinstance(data, Problem):   # (only for mypy: _read returned it above)
                problems.append(data)
                continue
            if size > limits.max_file_bytes:
                problems.append(Problem(file, (), _too_big(size, limits.max_file_bytes, "file")))
                continue
            total_bytes += size
            if total_bytes > limits.max_dir_bytes:
                problems.append(Problem(file, (), f"the catalog's files add up to more than "
                                                  f"{_mib(limits.max_dir_bytes)} with this one; not read"))
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


class _Deadline:
    """When a load gives up: checked between files and, inside one, every few thousand nodes.

    A load within the Limits takes a few seconds at most; one that takes many
    times that runs on a machine too loaded to say anything useful, and
    giving up stops the work (a thread left running would keep taking the
    interpreter from the router) instead of finishing an answer nobody waits for.
    """

    __slots__ = ("at", "seconds", "hit")

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds
        self.hit = False

    def passed(self) -> bool:
        if self.at is not None and time.monotonic() > self.at:
            self.hit = True
        return self.hit

    def message(self) -> str:
        return (f"validating the catalog took longer than {self.seconds:g} s (the most a load within the "
                "catalog's limits should take many times over); not read further. Is the machine overloaded?")


_NO_DEADLINE = _Deadline(None)
_collector_lock = threading.Lock()
_collector_holders = 0
_collector_was_enabled = False


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a load runs, on again (if it was) when the last load ends.

    A load allocates an object or more per YAML node and keeps most of them
    until it ends, so the collector's young passes promote them and its full
    passes walk them all -- with the interpreter held, from the loading
    thread, which stalls the event loop sharing the process (the router) for
    as long as one full pass takes, and made up a third of a big load's time.
    What a load allocates holds no cycles worth collecting meanwhile, and a
    load is bounded (Limits), so collecting after it loses nothing.
    """
    global _collector_holders, _collector_was_enabled
    with _collector_lock:
        if _collector_holders == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_holders += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_holders -= 1
            if _collector_holders == 0 and _collector_was_enabled:
                gc.enable()


def _mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB"


def _too_big(size: int, limit: int, what: str) -> str:
    return f"{what} is larger than {_mib(limit)} ({size} bytes or more); no catalog file is that big"


def read_file(path: str, root: str | None, max_bytes: int) -> bytes | Problem:
    """A catalog file's bytes, or the Problem of why it is not read.

    Never blocks and never reads more than `max_bytes` + 1: only a regular
    file is opened (checked before and, against a swap, after open), with
    O_NONBLOCK so not even a FIFO put there between the two checks can hold
    the read. When `root` is given, a symlink is followed only if it resolves
    inside it; its target is then not even opened.
    """
    got = _read(path, root, max_bytes, None)
    if isinstance(got, Problem):
        return got
    assert got[0] is not None
    return got[0]


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read(path: str, root: str | None, max_bytes: int, cache: FileCache | None
          ) -> Problem | tuple[bytes | None, tuple[int, ...] | None, int, _FileResult | None]:
    """(bytes, stat key, size, None) of a file read; (None, key, size, result) when `cache` knows it unchanged.

    The stat key is taken from the open file before reading, so a write
    during the read changes the file's stat after it and the next load reads
    it again; it is None (never trusted) when the file was modified within
    RACY_NS of the read.
    """
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            link = os.readlink(path)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return Problem(path, (), f"broken symlink to {excerpt(link, 200)}")
            target = os.path.realpath(path)
            if root is not None and os.path.commonpath([root, target]) != root:
                return Problem(path, (), f"is a symlink to {excerpt(target, 200)}, outside the catalog directory; "
                                         "only links that stay inside it (as a Kubernetes ConfigMap's ..data) "
                                         "are followed")
        if stat.S_ISDIR(st.st_mode):
            return Problem(path, (), "is a directory, not a catalog file")
        if not stat.S_ISREG(st.st_mode):
            return Problem(path, (), f"is {file_kind(st.st_mode)}, not a regular file; only regular files are read")
        if st.st_size > max_bytes:
            return Problem(path, (), _too_big(st.st_size, max_bytes, "file"))
        if cache is not None:
            known = cache.by_stat(path, _stat_key(st))
            if known is not None:
                return None, _stat_key(st), st.st_size, known
        now_ns = time.time_ns()
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        # Deleted between listing and reading (an editor's rename dance); the
        # watcher reloads again on the next event.
        return Problem(path, (), "file disappeared while reading")
    except OSError as exc:
        return Problem(path, (), f"cannot read: {exc.strerror or exc}")
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            return Problem(path, (), "was replaced by something that is not a regular file while reading")
        racy = now_ns - max(opened.st_mtime_ns, opened.st_ctime_ns) < RACY_NS
        key = None if racy else _stat_key(opened)
        data = read_upto(fd, max_bytes)
        if cache is not None:
            cache.reads += 1
        return data, key, len(data), None
    except OSError as exc:
        return Problem(path, (), f"cannot read: {exc.strerror or exc}")
    finally:
        os.close(fd)


def load_text(text: str | bytes, file: str = "<input>", *, limits: Limits = DEFAULT_LIMITS) -> Catalog:
    """A catalog from one document's text (what `POST /api/v1/catalog` receives)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if len(data) > limits.max_file_bytes:
        raise CatalogError([Problem(file, (), _too_big(len(data), limits.max_file_bytes, "document"))])
    with _collector_paused():
        return _assemble([(file, _load_file(file, data, limits, limits.max_nodes,
                                            deadline=_Deadline(limits.max_seconds)))], [])


def _assemble(results: list[tuple[str, _FileResult]], problems: list[Problem]) -> Catalog:
    models: list[Model] = []
    engines: dict[str, EngineSpec] = {}
    positions: dict[str, Mapping[tuple, tuple[int, int]]] = {}
    broken: set[tuple[str, tuple]] = set()
    for file, result in results:
        problems.extend(result.problems)
        models.extend(result.models)
        broken.update((file, p.path) for p in result.problems)
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
        # Rules run on models the schema found broken too (built leniently, see
        # _lenient_model), so a file's problems come in one round; what those
        # rules say at a spot the schema already reported adds nothing.
        problems.extend(_locate(p, positions.get(p.file, {})) for p in exc.problems
                        if not _under_reported(p, broken))
        catalog = None
    if problems or catalog is None:
        raise CatalogError(_clamped(p) for p in problems)
    return catalog


def _under_reported(problem: Problem, broken: set[tuple[str, tuple]]) -> bool:
    path = tuple(problem.path)
    return any((problem.file, path[:n]) in broken for n in range(3, len(path) + 1))


def _clamped(problem: Problem) -> Problem:
    # The last guard of "a rejection never prints a file": whatever a rule or a
    # library wrote, one problem's message stays a line long.
    if len(problem.message) <= MAX_MESSAGE:
        return problem
    return Problem(problem.file, problem.path, problem.message[:MAX_MESSAGE] + "...", problem.line, problem.column)


def _locate(problem: Problem, positions: Mapping[tuple, tuple[int, int]]) -> Problem:
    """Give a problem the line and column of the deepest part of its path the file has."""
    path = tuple(problem.path)
    while path and path not in positions:
        path = path[:-1]
    line, col = positions.get(path, (1, 1))
    return Problem(problem.file, problem.path, problem.message, line, col)


# --- one file ---------------------------------------------------------------

def _load_file(file: str, data: bytes, limits: Limits = DEFAULT_LIMITS, node_budget: int | None = None, *,
               deadline: _Deadline = _NO_DEADLINE) -> _FileResult:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return _FileResult(problems=(Problem(file, (), f"not UTF-8: byte 0x{data[exc.start]:02x} cannot be decoded; save the file as UTF-8", line, col),))
    control = _NON_PRINTABLE.search(text)
    if control:
        code = ord(control.group())
        line = text.count("\n", 0, control.start()) + 1
        col = control.start() - (text.rfind("\n", 0, control.start()) + 1) + 1
        name = f" ({_CONTROL_NAMES[code]})" if code in _CONTROL_NAMES else ""
        return _FileResult(problems=(Problem(file, (), f"control character U+{code:04X}{name} is not allowed in YAML; "
                                                       "remove it (a binary file, or a paste gone wrong?)", line, col),))
    budget = limits.max_nodes if node_budget is None else node_budget
    try:
        nodes, refused = _measure(text, budget, limits.max_depth, deadline)
        if refused:
            return _FileResult(problems=(Problem(file, (), refused[0], *refused[1]),), nodes=nodes)
        loader = LOADER(text)
        try:
            node = loader.get_single_node()
            if node is None:
                # An empty file is rejected, not read as "no models": a file
                # truncated by a crashed editor or a half-done `> file` must not
                # tear down every model it used to define.
                return _FileResult(problems=(Problem(file, (), "file is empty: write a Catalog document (apiVersion: llmgw/v1, kind: Catalog) or delete the file", 1, 1),))
            positions: dict[tuple, tuple[int, int]] = {}
            found: list[tuple[tuple, str]] = []
            _walk(node, (), positions, found)
            try:
                document = loader.construct_document(node)
            except yaml.YAMLError:
                raise
            except (ValueError, TypeError, OverflowError, ArithmeticError) as exc:
                # An explicit tag whose value does not fit it (`!!float abc`,
                # `!!int 0x`): PyYAML lets the conversion's error through.
                mark = node.start_mark
                return _FileResult(problems=(Problem(file, (), f"invalid YAML value: {excerpt(str(exc), 80)[1:-1]}",
                                                     mark.line + 1, mark.column + 1),), positions=positions, nodes=nodes)
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
    problems = [Problem(file, path, msg, *positions.get(path, (0, 0))) for path, msg in found]
    if not isinstance(document, dict):
        problems.append(Problem(file, (), f"expected a mapping with apiVersion: llmgw/v1 and kind: Catalog, got {_kind(document)}", 1, 1))
        return _FileResult(problems=tuple(problems), positions=positions, nodes=nodes)
    raw_models = document.get("models")
    if isinstance(raw_models, list) and len(raw_models) > _models_per_file():
        # Refused before the schema and the rules see any of them: what they
        # cost per model is what the limit is there to bound.
        limit = _models_per_file()
        problems.append(Problem(file, ("models",), f"has more than {limit} items, the most one file may hold; "
                                                   "split the catalog into more files",
                                *positions.get(("models",), (0, 0))))
        return _FileResult(problems=tuple(problems), positions=positions, nodes=nodes)
    errors = _schema_errors(document)
    problems.extend(_locate(Problem(file, path, msg), positions) for path, msg in errors)
    # Every model and engine is still built and checked, the broken ones
    # leniently (a broken field replaced by a harmless stand-in), so one run
    # reports a typo in one model, a bad duration in it *and* a duplicate name
    # in another, instead of making the operator fix them one round at a time.
    # The errors under each model and engine, found once: looked up per item
    # they were models x errors, minutes for a big file with an error in each.
    bad_in: dict[tuple, list[tuple]] = {}
    for path in [path for path, _ in errors] + [path for path, _ in found]:
        bad_in.setdefault(tuple(path[:2]), []).append(tuple(path[2:]))
    models, engines = [], []
    for i, raw in enumerate(raw_models if isinstance(raw_models, list) else ()):
        if not i & 0x3FF and deadline.passed():
            problems.append(Problem(file, ("models", i), deadline.message(), *positions.get(("models", i), (0, 0))))
            break
        here = ("models", i)
        bad = bad_in.get(here, [])
        if not isinstance(raw, dict):
            continue  # the schema said what it should be
        model = None
        for _ in range(2):
            try:
                model = _lenient_model(raw, Origin(file, here), bad) if bad else _model(raw, Origin(file, here))
                break
            except _FieldError as exc:
                problems.append(_locate(Problem(file, here + exc.path, exc.message), positions))
                bad = bad + [exc.path]
            except Exception:  # noqa: BLE001 -- a stand-in that cannot be built only loses its extra problems
                if not bad:
                    raise
                break
        if model is None:
            continue
        models.append(model)
    raw_engines = document.get("engines")
    for name, raw in (raw_engines.items() if isinstance(raw_engines, dict) else ()):
        if ("engines", name) in bad_in or not isinstance(name, str):
            continue
        engines.append(EngineSpec(
            name=name, command=tuple(raw["command"]), health=raw.get("health", "/health"),
            metrics=raw.get("metrics"), routes=tuple(raw.get("routes", ())), origin=Origin(file, ("engines", name)),
        ))
    return _FileResult(tuple(models), tuple(engines), tuple(problems), positions, nodes)


def _measure(text: str, budget: int, max_depth: int,
             deadline: _Deadline = _NO_DEADLINE) -> tuple[int, tuple[str, tuple[int, int]] | None]:
    """Nodes the document holds with every alias expanded, from its event stream; why it is refused, if it is.

    Runs before anything is composed: the event parser keeps its own stack,
    so neither a deep nesting (which crashes libyaml's composer) nor an alias
    bomb (9 aliases of 9 aliases... is billions of nodes) costs more than the
    events up to the point where the budget runs out. An alias adds the size
    of what it names without expanding it.
    """
    loader = LOADER(text)
    count = NodeCount()
    events = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            events += 1
            recursive = count.add(event)
            if recursive is not None:
                return count.nodes, (f"alias *{excerpt(recursive)[1:-1]} refers to a node that contains it; "
                                     "a catalog cannot be recursive", _at_mark(event))
            if count.depth > max_depth:
                return count.nodes, (f"nested more than {max_depth} levels deep; a catalog is about 6",
                                     _at_mark(event))
            if not events & 0xFFF and deadline.passed():
                return count.nodes, (deadline.message(), _at_mark(event))
            if count.nodes > budget:
                return count.nodes, (f"holds more than {budget} YAML nodes (each alias counted at the size of "
                                     "what it repeats); an alias bomb, or a catalog to split", _at_mark(event))
    finally:
        loader.dispose()
    return count.nodes, None


def _at_mark(event: Any) -> tuple[int, int]:
    mark = event.start_mark
    return (mark.line + 1, mark.column + 1) if mark else (0, 0)


def _walk(node: yaml.Node, path: tuple, positions: dict, found: list[tuple[tuple, str]]) -> None:
    """Record where every value starts; note duplicate keys (PyYAML would silently merge them) and non-finite numbers.

    `_measure` bounded the expanded size and the depth, so this recursion is bounded too.
    """
    positions[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
            if key in seen:
                positions[path + (key,)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                found.append((path + (key,), f"key {excerpt(key)} appears twice in the same mapping; only one can count"))
                continue
            seen.add(key)
            _walk(value_node, path + (key,), positions, found)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, path + (i,), positions, found)
    elif isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:float":
        # (`!!float {a: 1}` is a mapping node with this tag: construct_document rejects it.)
        try:
            value = _CONSTRUCTOR.construct_yaml_float(node)
        except (ValueError, TypeError):
            return  # construct_document reports it
        if not math.isfinite(value):
            # NaN passes every "at least"/"at most" (it compares false), and
            # inf ends in an overflow wherever it is added to a clock.
            found.append((path, f"{excerpt(node.value)[1:-1]} is not a finite number; "
                                "no number in a catalog may be .nan or .inf"))


def _kind(value: Any) -> str:
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
def _models_per_file() -> int:
    """The schema's bound on one file's models (models.maxItems)."""
    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    return int(schema["properties"]["models"]["maxItems"])


@lru_cache(maxsize=1)
def _model_validator():
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


def _schema_errors(document: dict) -> list[tuple[tuple, str]]:
    compiled = _compiled()
    if compiled is not None and _passes(compiled[0], document):
        return []
    model_check = compiled[1] if compiled is not None else None
    out: list[tuple[tuple, str]] = []
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
        types = [_json_type(t) for e in error.context if e.validator == "type"
                 for t in (e.validator_value if isinstance(e.validator_value, list) else [e.validator_value])]
        return [(path, f"expected {' or '.join(dict.fromkeys(types))}, got {_kind(inst)}")]
    if v == "type":
        wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        msg = f"expected {' or '.join(_json_type(t) for t in wanted)}, got {_kind(inst)}"
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
            out.append((path + (key,), f"unknown field {excerpt(key)}; {hint}"))
        return out
    if v == "const":
        return [(path, f"expected {error.validator_value!r}, got {_kind(inst)}")]
    if v == "pattern":
        what = error.schema.get("description") or f"a value matching {error.validator_value}"
        return [(path, f"{excerpt(inst)} is not allowed here: expected {what[0].lower() + what[1:] if what else what}".rstrip(".")
                 + f" (pattern {error.validator_value})")]
    if v == "propertyNames":
        return [(path + (inst,) if isinstance(inst, str) else path, _short_message(error))]
    if v == "minItems":
        return [(path, f"needs at least {error.validator_value} item{'s' if error.validator_value != 1 else ''}")]
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {"minimum": "at least", "maximum": "at most", "exclusiveMinimum": "greater than", "exclusiveMaximum": "less than"}
        return [(path, f"expected a number {words[v]} {error.validator_value}, got {excerpt(inst)}")]
    if v == "minLength":
        return [(path, "must not be empty")]
    if v == "maxLength":
        return [(path, f"is longer than {error.validator_value} characters")]
    if v == "maxItems":
        return [(path, f"has more than {error.validator_value} items, the most allowed here")]
    if v == "maxProperties":
        return [(path, f"has more than {error.validator_value} entries, the most allowed here")]
    return [(path, _short_message(error))]


def _short_message(error) -> str:
    # jsonschema's own messages start with the instance's repr, which may be a
    # whole mapping of the file: say what is wrong without it.
    message = str(error.message)
    text = repr(error.instance)
    return message.replace(text, excerpt(error.instance)) if len(text) > EXCERPT else message


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
    profiles = tuple(_profile(p, i) for i, p in enumerate(raw["profiles"]))
    return Model(
        name=raw["name"], profiles=profiles, source=raw.get("source") or raw["name"],
        aliases=tuple(raw.get("aliases") or ()), replicas=replicas, idle_timeout=idle,
        priority=raw.get("priority", 0), origin=origin,
        autoscale=_autoscale(raw.get("autoscale")),
        routing=raw.get("routing"),
        continuation=_continuation(raw.get("continuation")),
    )


def _continuation(raw: Any) -> int:
    """The hand-overs a cut stream may make: true (the default count), false or absent (0), or {attempts: N}."""
    if raw is True:
        return CONTINUATION_ATTEMPTS
    if isinstance(raw, dict):
        return int(raw.get("attempts", CONTINUATION_ATTEMPTS))
    return 0


_DEFAULT_AUTOSCALE = Autoscale()


def _autoscale(raw: Mapping[str, Any] | None) -> Autoscale:
    """The model's autoscale block; absent or null: the defaults (see catalog.model.Autoscale)."""
    if not raw:
        return Autoscale()
    window = raw.get("scale_down_window", _DEFAULT_AUTOSCALE.scale_down_window)
    try:
        window = parse_duration(window)
    except ValueError as exc:
        raise _FieldError(("autoscale", "scale_down_window"), str(exc)) from None
    target = raw.get("target")
    return Autoscale(metric=raw.get("metric", "inflight"),
                     target=float(target) if isinstance(target, (int, float)) and not isinstance(target, bool) else target,
                     scale_down_window=window, fast_factor=raw.get("fast_factor", _DEFAULT_AUTOSCALE.fast_factor),
                     max_step=raw.get("max_step", _DEFAULT_AUTOSCALE.max_step),
                     tolerance=raw.get("tolerance", _DEFAULT_AUTOSCALE.tolerance))


def _lenient_model(raw: Mapping[str, Any], origin: Origin, bad: list[tuple]) -> Model:
    """A stand-in for a model the schema found broken, so the other rules can still run on what is fine in it.

    A field with an error at or under it is replaced by something no rule
    objects to (a default, a name nothing else can have); it is never in force,
    since the catalog it belongs to is rejected anyway.
    """
    # A path is fine when no error is at or under it: when it is not a prefix
    # of any error's path. A set of those prefixes makes that one lookup.
    spoiled = {p[:n] for p in bad for n in range(len(p) + 1)}

    def fine(*path) -> bool:
        return path not in spoiled

    stand_in = f"\0broken:{origin.file}:{origin.path}"
    clean = {k: v for k, v in raw.items() if isinstance(k, str) and fine(k)}
    clean["name"] = raw["name"] if fine("name") and isinstance(raw.get("name"), str) else stand_in
    aliases = raw.get("aliases") if fine("aliases") or isinstance(raw.get("aliases"), list) else []
    clean["aliases"] = [a if fine("aliases", i) and isinstance(a, str) else f"{stand_in}:{i}"
                        for i, a in enumerate(aliases if isinstance(aliases, list) else [])]
    raw_profiles = raw.get("profiles")
    profiles = raw_profiles if isinstance(raw_profiles, list) else []
    clean["profiles"] = [
        {k: v for k, v in p.items() if isinstance(k, str) and fine("profiles", j, k)}
        | {"name": p.get("name") if fine("profiles", j, "name") and isinstance(p.get("name"), str) else f"{stand_in}:{j}",
           "engine": p.get("engine") if fine("profiles", j, "engine") and isinstance(p.get("engine"), str) else "fake"}
        if isinstance(p, dict) else {"name": f"{stand_in}:{j}", "engine": "fake"}
        for j, p in enumerate(profiles)] or [{"name": stand_in, "engine": "fake"}]
    return _model(clean, origin)


def _profile(raw: Mapping[str, Any], i: int = 0) -> Profile:
    memory = raw.get("gpu_memory")
    if memory is not None:
        try:
            memory = parse_size_mib(memory)
        except ValueError as exc:
            raise _FieldError(("profiles", i, "gpu_memory"), str(exc)) from None
    return Profile(
        gpu_memory_mib=memory,
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
