"""The immutable catalog: models, their aliases and profiles, and the engines they name.

A `Catalog` is built only through its constructor, which checks every rule that
spans more than one field (a name used twice, an unknown engine, min > max...).
Once built nothing in it can change: every collection is a tuple or a read-only
mapping, every class a frozen dataclass. What changes in a running llmgw is
*which* catalog is current (see `live.py`), so a reader that took one catalog
finishes its work against it even if a newer one is swapped in meanwhile.
"""
from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from .durations import format_duration
from .errors import CatalogError, Problem, format_path

API_VERSION = "llmgw/v1"
KIND = "Catalog"

# Placeholders an engine command template may use; anything else in braces is a
# typo that would otherwise reach the engine's command line verbatim.
TEMPLATE_FIELDS = frozenset({"source", "port", "host", "model", "gpus"})


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a model was written: its file and its path inside that document.

    Kept so rules checked across files can still point at a line.
    """

    file: str = ""
    path: tuple[str | int, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How to launch and probe one kind of inference server.

    Built-in engines carry no command here: their drivers (llmgwctl.engines)
    know it. A catalog-defined engine gives a command template whose
    placeholders are filled per replica: {source} {port} {host} {model} {gpus}.
    """

    name: str
    command: tuple[str, ...] = ()
    health: str = "/health"
    metrics: str | None = None
    builtin: bool = False
    origin: Origin = field(default=Origin(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"command": list(self.command), "health": self.health}
        if self.metrics is not None:
            out["metrics"] = self.metrics
        return out


BUILTIN_ENGINES: Mapping[str, EngineSpec] = MappingProxyType({
    "vllm": EngineSpec("vllm", health="/health", metrics="/metrics", builtin=True),
    "sglang": EngineSpec("sglang", health="/health", metrics="/metrics", builtin=True),
    "llamacpp": EngineSpec("llamacpp", health="/health", metrics="/metrics", builtin=True),
    "fake": EngineSpec("fake", health="/health", metrics="/metrics", builtin=True),
})


@dataclass(frozen=True, slots=True)
class Replicas:
    """How many replicas of a model may run: start at `min`, grow up to `max`."""

    min: int = 1
    max: int = 1

    def to_yaml(self) -> Any:
        return self.min if self.min == self.max else {"min": self.min, "max": self.max}


@dataclass(frozen=True, slots=True)
class Profile:
    """One way to run a model: an engine on some number of GPUs of a pool."""

    name: str
    engine: str
    pool: str | None = None
    gpus: int = 1
    source: str | None = None  # overrides the model's source for this engine only
    priority: int = 0
    weight: float = 1.0
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "engine": self.engine}
        if self.source is not None:
            out["source"] = self.source
        if self.pool is not None:
            out["pool"] = self.pool
        out.update(gpus=self.gpus, priority=self.priority, weight=self.weight)
        if self.args:
            out["args"] = list(self.args)
        if self.env:
            out["env"] = dict(self.env)
        return out


@dataclass(frozen=True, slots=True)
class Model:
    """A model operators want served, under its name and aliases.

    `profiles` keep the written order (so errors and `show` point where the
    operator wrote them); `ranked()` gives them best first, the order
    placement tries them in.
    `idle_timeout` is seconds without requests before scaling down to
    `replicas.min`; None means never.
    """

    name: str
    profiles: tuple[Profile, ...]
    source: str = ""
    aliases: tuple[str, ...] = ()
    replicas: Replicas = Replicas()
    idle_timeout: float | None = None
    origin: Origin = field(default=Origin(), compare=False)

    def ranked(self) -> tuple[Profile, ...]:
        """Profiles by priority, highest first; the written order breaks ties."""
        return tuple(sorted(self.profiles, key=lambda p: -p.priority))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.aliases:
            out["aliases"] = list(self.aliases)
        out["source"] = self.source
        out["replicas"] = self.replicas.to_yaml()
        if self.idle_timeout is not None:
            out["idle_timeout"] = format_duration(self.idle_timeout)
        out["profiles"] = [p.to_dict() for p in self.profiles]
        return out


class Catalog:
    """The whole set of models llmgw should serve; valid by construction, never mutated.

    `resolve(name_or_alias)` is one dict lookup. `version` is a hash of the
    content (not of the files' bytes), so reformatting a file or editing a
    comment yields the same version and no swap.
    """

    __slots__ = ("_models", "_engines", "_index", "_version")

    def __init__(self, models: Iterable[Model] = (), engines: Mapping[str, EngineSpec] | None = None):
        models = tuple(models)
        all_engines = dict(BUILTIN_ENGINES)
        problems: list[Problem] = []
        for spec in (engines or {}).values():
            if spec.name in BUILTIN_ENGINES:
                problems.append(_at(spec.origin, (), f"redefines the built-in engine {spec.name!r}; choose another name"))
                continue
            problems.extend(_at(spec.origin, path, msg) for path, msg in _check_engine(spec))
            all_engines[spec.name] = spec
        index: dict[str, Model] = {}
        # name -> where it was first used, so the second use can point back at the first
        first_use: dict[str, tuple[str, tuple[str | int, ...], str]] = {}
        for model in models:
            problems.extend(_check_model(model, all_engines))
            for key, what, path in _names_of(model):
                path = model.origin.path + path
                if key in first_use:
                    file, first_path, first_what = first_use[key]
                    problems.append(Problem(
                        model.origin.file, path,
                        f"{what} {key!r} is already {first_what} of model {index[key].name!r} "
                        f"({file or 'same document'}: {format_path(first_path)}); "
                        "names and aliases must be unique across the whole catalog",
                    ))
                    continue
                first_use[key] = (model.origin.file, path, "the name" if what == "name" else "an alias")
                index[key] = model
        if problems:
            raise CatalogError(problems)
        self._models = models
        self._engines = MappingProxyType(all_engines)
        self._index = MappingProxyType(index)
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        self._version = hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def __setattr__(self, name: str, value: Any) -> None:
        # Only __init__ may set the slots, and only once: after that a Catalog is frozen.
        if hasattr(self, "_version"):
            raise AttributeError("Catalog is immutable; build a new one and swap it in Live")
        object.__setattr__(self, name, value)

    @property
    def models(self) -> tuple[Model, ...]:
        return self._models

    @property
    def engines(self) -> Mapping[str, EngineSpec]:
        return self._engines

    @property
    def version(self) -> str:
        return self._version

    def resolve(self, name_or_alias: str) -> Model | None:
        return self._index.get(name_or_alias)

    def names(self) -> tuple[str, ...]:
        """Every name and alias that resolves, for `/v1/models` and "did you mean"."""
        return tuple(self._index)

    def __len__(self) -> int:
        return len(self._models)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Catalog) and other._version == self._version and other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(self._version)

    def __repr__(self) -> str:
        return f"<Catalog {self._version}: {len(self._models)} models>"

    def to_dict(self) -> dict[str, Any]:
        """The catalog as one document that loads back to an equal catalog."""
        out: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND,
                               "models": [m.to_dict() for m in self._models]}
        custom = {n: e.to_dict() for n, e in self._engines.items() if not e.builtin}
        if custom:
            out["engines"] = custom
        return out


def _at(origin: Origin, path: tuple[str | int, ...], message: str) -> Problem:
    return Problem(origin.file, origin.path + path, message)


def _names_of(model: Model):
    yield model.name, "name", ("name",)
    for i, alias in enumerate(model.aliases):
        # A repeat inside the model itself is reported once, by _check_model.
        if alias != model.name and alias not in model.aliases[:i]:
            yield alias, "alias", ("aliases", i)


def _check_model(model: Model, engines: Mapping[str, EngineSpec]) -> Iterable[Problem]:
    file, base = model.origin.file, model.origin.path
    if model.replicas.min > model.replicas.max:
        yield Problem(file, base + ("replicas",), f"min ({model.replicas.min}) is greater than max ({model.replicas.max})")
    for i, alias in enumerate(model.aliases):
        if alias == model.name:
            yield Problem(file, base + ("aliases", i), f"alias {alias!r} repeats the model's own name; remove it")
        elif alias in model.aliases[:i]:
            yield Problem(file, base + ("aliases", i), f"alias {alias!r} is listed twice")
    if not model.profiles:
        yield Problem(file, base + ("profiles",), "a model needs at least one profile")
    seen: dict[str, int] = {}
    known = ", ".join(sorted(engines))
    for i, profile in enumerate(model.profiles):
        if profile.engine not in engines:
            yield Problem(file, base + ("profiles", i, "engine"), f"{profile.engine!r} is not one of {known}")
        if profile.name in seen:
            yield Problem(file, base + ("profiles", i, "name"),
                          f"profile name {profile.name!r} is already used by profiles[{seen[profile.name]}]; "
                          "give each profile of a model its own name (an unnamed profile is named after its engine)")
        else:
            seen[profile.name] = i


def _check_engine(spec: EngineSpec) -> Iterable[tuple[tuple[str | int, ...], str]]:
    if not spec.command:
        yield ("command",), "a catalog-defined engine needs a command"
    for i, part in enumerate(spec.command):
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(part) if f is not None}
        except ValueError as exc:
            yield ("command", i), f"bad template {part!r}: {exc}"
            continue
        unknown = sorted(f for f in fields if f not in TEMPLATE_FIELDS)
        if unknown:
            yield ("command", i), (f"unknown placeholder {{{unknown[0]}}}; expected one of "
                                   + ", ".join("{" + f + "}" for f in sorted(TEMPLATE_FIELDS)))
    for key in ("health", "metrics"):
        value = getattr(spec, key)
        if value is not None and not value.startswith("/"):
            yield (key,), f"expected a path starting with '/', got {value!r}"

