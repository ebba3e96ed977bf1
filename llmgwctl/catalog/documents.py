"""A catalog document into models and engines: the schema, then each field's own rules.

Owns turning one parsed document -- from a file (`yamldoc`) or already
parsed (a watch answer, `loader.load_document`) -- into the models and
engines it defines, or the problems that stop it: too many models, what the
schema refuses (`schema`), and what no schema can say (a duration or a size
that does not parse). Broken models are still built, leniently, so the
rules across the whole catalog (`model.Catalog`) can report on the rest in
the same round.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .durations import parse_duration
from .errors import Problem, excerpt
from .limits import NO_DEADLINE, Deadline
from .model import (
    CONTINUATION_ATTEMPTS,
    LORA_DEFAULTS,
    Adapter,
    Autoscale,
    EngineSpec,
    Lora,
    Model,
    Origin,
    Profile,
    Replicas,
)
from .schema import kind, locate, models_per_file, schema_errors
from .sizes import parse_size_mib
from .yamldoc import DocPath, Finding, Positions, not_finite


@dataclass(frozen=True)
class FileResult:
    """What one file contributes: its models and engines if it was valid, else its problems.

    `positions` is None for a document that came without text: nothing in it has a line.
    """

    models: tuple[Model, ...] = ()
    engines: tuple[EngineSpec, ...] = ()
    problems: tuple[Problem, ...] = ()
    positions: Positions | None = field(default_factory=dict)
    nodes: int = 0                  # YAML nodes, aliases expanded: what it costs against Limits.max_nodes


def check(file: str, document: Any, positions: Positions | None, found: tuple[Finding, ...] = (), nodes: int = 0,
          deadline: Deadline = NO_DEADLINE) -> FileResult:
    """The models and engines `document` defines, with every problem found in it located by `positions`."""

    def at(path: DocPath) -> tuple[int, int]:
        return (0, 0) if positions is None else positions.get(path, (0, 0))

    problems = [Problem(file, path, msg, *at(path)) for path, msg in found]
    if not isinstance(document, dict):
        problems.append(Problem(file, (), "expected a mapping with apiVersion: llmgw/v1 and kind: Catalog, "
                                          f"got {kind(document)}", *((0, 0) if positions is None else (1, 1))))
        return FileResult(problems=tuple(problems), positions=positions, nodes=nodes)
    raw_models = document.get("models")
    if isinstance(raw_models, list) and len(raw_models) > models_per_file():
        # Refused before the schema and the rules see any of them: what they
        # cost per model is what the limit is there to bound.
        limit = models_per_file()
        problems.append(Problem(file, ("models",), f"has more than {limit} items, the most one file may hold; "
                                                   "split the catalog into more files", *at(("models",))))
        return FileResult(problems=tuple(problems), positions=positions, nodes=nodes)
    errors = schema_errors(document)
    problems.extend(locate(Problem(file, path, msg), positions) for path, msg in errors)
    # Every model and engine is still built and checked, the broken ones
    # leniently (a broken field replaced by a harmless stand-in), so one run
    # reports a typo in one model, a bad duration in it *and* a duplicate name
    # in another, instead of making the operator fix them one round at a time.
    # The errors under each model and engine, found once: looked up per item
    # they were models x errors, minutes for a big file with an error in each.
    bad_in: dict[DocPath, list[DocPath]] = {}
    for path in [path for path, _ in errors] + [path for path, _ in found]:
        bad_in.setdefault(tuple(path[:2]), []).append(tuple(path[2:]))
    models: list[Model] = []
    engines: list[EngineSpec] = []
    for i, raw in enumerate(raw_models if isinstance(raw_models, list) else ()):
        if not i & 0x3FF and deadline.passed():
            problems.append(Problem(file, ("models", i), deadline.message(), *at(("models", i))))
            break
        here: DocPath = ("models", i)
        bad = bad_in.get(here, [])
        if not isinstance(raw, dict):
            continue  # the schema said what it should be
        model = None
        for _ in range(2):
            try:
                model = _lenient_model(raw, Origin(file, here), bad) if bad else _model(raw, Origin(file, here))
                break
            except _FieldError as exc:
                problems.append(locate(Problem(file, here + exc.path, exc.message), positions))
                bad = bad + [exc.path]
            except Exception:
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
    return FileResult(tuple(models), tuple(engines), tuple(problems), positions, nodes)


def measure_document(document: Any, max_depth: int) -> tuple[int, tuple[Finding, ...], str | None]:
    """What `yamldoc` notes of a file, for a document already parsed: its nodes, its non-finite numbers,
    and why it is refused whole (nested past `max_depth`), if it is.

    Iterative, so a document nested deeper than the interpreter's stack is
    refused, not a RecursionError.
    """
    nodes = 0
    found: list[Finding] = []
    stack: list[tuple[DocPath, Any]] = [((), document)]
    while stack:
        path, value = stack.pop()
        nodes += 1
        if isinstance(value, (dict, list)) and len(path) >= max_depth:
            return nodes, tuple(found), f"nested more than {max_depth} levels deep; a catalog is about 6"
        if isinstance(value, dict):
            stack.extend((path + (key,), item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((path + (i,), item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, float) and not math.isfinite(value):
            found.append((path, not_finite(excerpt(value))))
    return nodes, tuple(found), None


class _FieldError(Exception):
    """A field the schema let through that its own rule refuses (a duration, a size), at `path` under its model."""

    def __init__(self, path: DocPath, message: str):
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
        context_length=raw.get("context_length"),
        fallbacks=tuple(raw.get("fallbacks") or ()),
        adapters=tuple(_adapter(a, i) for i, a in enumerate(raw.get("adapters") or ())),
        lora=_lora(raw.get("lora")),
    )


def _adapter(raw: Mapping[str, Any], i: int) -> Adapter:
    replicas = raw.get("replicas", "all")
    ceiling = None
    if isinstance(replicas, dict):
        replicas, ceiling = replicas["min"], replicas["max"]
    return Adapter(name=raw["name"], source=raw.get("source") or raw["name"],
                   aliases=tuple(raw.get("aliases") or ()), replicas=None if replicas == "all" else replicas,
                   max_replicas=ceiling, autoscale=_autoscale(raw.get("autoscale"), ("adapters", i)))


def _lora(raw: Mapping[str, Any] | None) -> Lora | None:
    """The model's `lora:` block; absent or null: None (the defaults apply once it has adapters)."""
    if not raw:
        return None
    return Lora(max_loras=raw.get("max_loras", LORA_DEFAULTS[0]), max_rank=raw.get("max_rank", LORA_DEFAULTS[1]))


def _continuation(raw: Any) -> int:
    """The hand-overs a cut stream may make: true (the default count), false or absent (0), or {attempts: N}."""
    if raw is True:
        return CONTINUATION_ATTEMPTS
    if isinstance(raw, dict):
        return int(raw.get("attempts", CONTINUATION_ATTEMPTS))
    return 0


_DEFAULT_AUTOSCALE = Autoscale()


def _autoscale(raw: Mapping[str, Any] | None, under: DocPath = ()) -> Autoscale:
    """A model's (or, `under` its adapter's path, an adapter's) autoscale block; absent or null: the
    defaults (see catalog.model.Autoscale)."""
    if not raw:
        return Autoscale()
    window = raw.get("scale_down_window", _DEFAULT_AUTOSCALE.scale_down_window)
    try:
        window = parse_duration(window)
    except ValueError as exc:
        raise _FieldError((*under, "autoscale", "scale_down_window"), str(exc)) from None
    target = raw.get("target")
    return Autoscale(metric=raw.get("metric", "inflight"),
                     target=float(target) if isinstance(target, (int, float)) and not isinstance(target, bool) else target,
                     scale_down_window=window, fast_factor=raw.get("fast_factor", _DEFAULT_AUTOSCALE.fast_factor),
                     max_step=raw.get("max_step", _DEFAULT_AUTOSCALE.max_step),
                     tolerance=raw.get("tolerance", _DEFAULT_AUTOSCALE.tolerance))


def _lenient_model(raw: Mapping[str, Any], origin: Origin, bad: list[DocPath]) -> Model:
    """A stand-in for a model the schema found broken, so the other rules can still run on what is fine in it.

    A field with an error at or under it is replaced by something no rule
    objects to (a default, a name nothing else can have); it is never in force,
    since the catalog it belongs to is rejected anyway.
    """
    # A path is fine when no error is at or under it: when it is not a prefix
    # of any error's path. A set of those prefixes makes that one lookup.
    spoiled = {p[:n] for p in bad for n in range(len(p) + 1)}

    def fine(*path: str | int) -> bool:
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
    raw_adapters = raw.get("adapters")
    adapters: list[dict[str, Any]] = []
    for j, a in enumerate(raw_adapters if isinstance(raw_adapters, list) else []):
        if not isinstance(a, dict):
            continue
        listed = a.get("aliases")
        adapters.append({
            "name": a["name"] if fine("adapters", j, "name") and isinstance(a.get("name"), str) else f"{stand_in}:a{j}",
            "source": a["source"] if fine("adapters", j, "source") and isinstance(a.get("source"), str) else "x",
            "aliases": [x if fine("adapters", j, "aliases", k) and isinstance(x, str) else f"{stand_in}:a{j}:{k}"
                        for k, x in enumerate(listed if isinstance(listed, list) else [])],
            "replicas": a.get("replicas", "all") if fine("adapters", j, "replicas") else "all"}
            | ({"autoscale": a["autoscale"]} if fine("adapters", j, "autoscale") and isinstance(a.get("autoscale"), dict)
               else {}))
    clean["adapters"] = adapters
    if not fine("lora"):
        clean.pop("lora", None)
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
        nodes=raw.get("nodes", 1), parallel=raw.get("parallel"),
        args=tuple(_scalar(a) for a in raw.get("args") or ()),
        env=MappingProxyType({k: _scalar(v) for k, v in (raw.get("env") or {}).items()}),
    )


def _scalar(value: Any) -> str:
    # YAML reads `- 32768` args and `FOO: 1` env values as numbers; the engine
    # sees text either way, so accept both rather than make operators quote them.
    return str(value)
