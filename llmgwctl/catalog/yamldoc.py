"""One catalog file's bytes into a document, with the line and column of every value in it.

Owns the YAML side of a load: decoding, refusing what PyYAML would choke on
or expand without bound (control characters, alias bombs, deep nesting,
recursion) before anything is composed, composing, and noting what YAML
allows but a catalog must not hold (a key twice in one mapping, .nan/.inf).
What the document means is `documents`'s business, not this module's.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import yaml

from ..yamlkit import LOADER, NodeCount
from .errors import Problem, excerpt
from .limits import NO_DEADLINE, Deadline, Limits

# A place in a document: mapping keys and list indices from its root.
DocPath = tuple[str | int, ...]
# Where each value of a file starts: path -> (line, column), both 1-based.
Positions = Mapping[DocPath, tuple[int, int]]
# What a walk notes beside the positions: (path, what is wrong there).
Finding = tuple[DocPath, str]

_CONSTRUCTOR = yaml.constructor.SafeConstructor()        # only to read floats' values while walking nodes
# What PyYAML's reader refuses; found first by us, so the problem has a line:col.
_NON_PRINTABLE = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010ffff]")
_CONTROL_NAMES = {0: "NUL", 0x1b: "ESC", 0x7f: "DEL"}


class Parsed(NamedTuple):
    """A file's document, where its values are, what YAML let through that a catalog refuses, and its size."""

    document: Any
    positions: Positions
    found: tuple[Finding, ...]
    nodes: int


@dataclass(frozen=True, slots=True)
class Unparsed:
    """Why a file gave no document; `positions` and `nodes` as far as parsing got."""

    problem: Problem
    positions: Positions
    nodes: int = 0


def parse(file: str, data: bytes, limits: Limits, budget: int, deadline: Deadline = NO_DEADLINE) -> Parsed | Unparsed:
    """The document in `data` with its positions, or the one problem that stopped it being read."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return Unparsed(Problem(file, (), f"not UTF-8: byte 0x{data[exc.start]:02x} cannot be decoded; save the file as UTF-8", line, col), {})
    control = _NON_PRINTABLE.search(text)
    if control:
        code = ord(control.group())
        line = text.count("\n", 0, control.start()) + 1
        col = control.start() - (text.rfind("\n", 0, control.start()) + 1) + 1
        name = f" ({_CONTROL_NAMES[code]})" if code in _CONTROL_NAMES else ""
        return Unparsed(Problem(file, (), f"control character U+{code:04X}{name} is not allowed in YAML; "
                                          "remove it (a binary file, or a paste gone wrong?)", line, col), {})
    try:
        nodes, refused = measure(text, budget, limits.max_depth, deadline)
        if refused:
            return Unparsed(Problem(file, (), refused[0], *refused[1]), {}, nodes)
        loader = LOADER(text)
        try:
            node = loader.get_single_node()
            if node is None:
                # An empty file is rejected, not read as "no models": a file
                # truncated by a crashed editor or a half-done `> file` must not
                # tear down every model it used to define.
                return Unparsed(Problem(file, (), "file is empty: write a Catalog document (apiVersion: llmgw/v1, "
                                                  "kind: Catalog) or delete the file", 1, 1), {})
            positions: dict[DocPath, tuple[int, int]] = {}
            found: list[Finding] = []
            _walk(node, (), positions, found)
            try:
                document = loader.construct_document(node)
            except yaml.YAMLError:
                raise
            except (ValueError, TypeError, OverflowError, ArithmeticError) as exc:
                # An explicit tag whose value does not fit it (`!!float abc`,
                # `!!int 0x`): PyYAML lets the conversion's error through.
                mark = node.start_mark
                return Unparsed(Problem(file, (), f"invalid YAML value: {excerpt(str(exc), 80)[1:-1]}",
                                        mark.line + 1, mark.column + 1), positions, nodes)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = str(exc.problem or exc.context)
        if exc.context and exc.problem and exc.context_mark:
            message += f" ({exc.context} started at line {exc.context_mark.line + 1})"
        if "expected a single document" in message:
            message = "holds more than one YAML document (---); put one Catalog per file"
        return Unparsed(Problem(file, (), f"invalid YAML: {message}", mark.line + 1 if mark else 0,
                                mark.column + 1 if mark else 0), {})
    except yaml.YAMLError as exc:
        return Unparsed(Problem(file, (), f"invalid YAML: {exc}"), {})
    return Parsed(document, positions, tuple(found), nodes)


def measure(text: str, budget: int, max_depth: int,
            deadline: Deadline = NO_DEADLINE) -> tuple[int, tuple[str, tuple[int, int]] | None]:
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


def _at_mark(event: yaml.Event) -> tuple[int, int]:
    mark = event.start_mark
    return (mark.line + 1, mark.column + 1) if mark else (0, 0)


def _walk(node: yaml.Node, path: DocPath, positions: dict[DocPath, tuple[int, int]], found: list[Finding]) -> None:
    """Record where every value starts; note duplicate keys (PyYAML would silently merge them) and non-finite numbers.

    `measure` bounded the expanded size and the depth, so this recursion is bounded too.
    """
    positions[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
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
            found.append((path, not_finite(excerpt(node.value)[1:-1])))


def not_finite(shown: str) -> str:
    # NaN passes every "at least"/"at most" (it compares false), and inf ends
    # in an overflow wherever it is added to a clock.
    return f"{shown} is not a finite number; no number in a catalog may be .nan or .inf"
