"""The immutable catalog: models, their aliases and profiles, and the engines they name.

A `Catalog` is built only through its constructor, which checks every rule that
spans more than one field (a name used twice, an unknown engine, min > max...).
Once built nothing in it can change: every collection is a tuple or a read-only
mapping, every class a frozen dataclass. What changes in a running llmgw is
*which* catalog is current (see `live.py`), so a reader that took one catalog
finishes its work against it even if a newer one is swapped in meanwhile.

The rules one model keeps on its own are `modelrules`; the names of routing
policies and LoRA engines it owns are re-exported here, being part of the
model's vocabulary (`catalog.model.ROUTING_POLICIES` is what the router's
registry test holds its names to).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .bounds import MAX_TOTAL_REPLICAS
from .commands import check_engine
from .durations import format_duration
from .errors import CatalogError, Problem, format_path
from .fallbacks import check_fallbacks
from .modelrules import LORA_ENGINES as LORA_ENGINES
from .modelrules import ROUTING_POLICIES as ROUTING_POLICIES
from .modelrules import check_model
from .multinode import parallelism, written
from .sizes import format_size_mib

API_VERSION = "llmgw/v1"
KIND = "Catalog"
# `continuation: true`'s hand-overs per stream: the first covers the replica
# that died, a second one whose replacement died too (a node going down with
# both); a stream cut three times has a model in trouble, and the client
# should hear it.
CONTINUATION_ATTEMPTS = 2


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
    # Client routes this engine serves beyond the router's own table
    # (router.routes), e.g. /v1/score: POSTed with the model in the body.
    routes: tuple[str, ...] = ()
    origin: Origin = field(default=Origin(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"command": list(self.command), "health": self.health}
        if self.metrics is not None:
            out["metrics"] = self.metrics
        if self.routes:
            out["routes"] = list(self.routes)
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


# Signals the autoscaler can follow, and the target per replica each gets when
# the catalog names none. Why these defaults, for a vLLM replica:
# - inflight 16: requests in flight per replica as the routers count them
#   (immediate, for every engine, other routers' traffic included). vLLM
#   batches dozens of sequences, so below 16 a new replica costs a GPU without
#   helping latency; it was llmgw's fixed scale-up point before autoscaling
#   had a target, so fleets tuned for that behave as they did.
# - waiting 2: requests queued at the engine beyond its batch (vLLM's
#   num_requests_waiting). A request or two waiting is the normal edge of a
#   full batch; more means the batch limit, not the GPU's speed, sets latency.
#   A queue signal: once nothing waited for a whole stable window, the model
#   goes back toward min; suits bursty batch traffic more than steady chat.
# - kv_cache 0.7: the engine's KV-cache use, 0-1, summed over replicas (1.4 =
#   two replicas' worth). vLLM preempts sequences as it nears 1 and the router
#   counts 0.95 as full; 0.7 leaves the running sequences room to grow.
AUTOSCALE_METRICS: Mapping[str, float] = MappingProxyType({"inflight": 16.0, "waiting": 2.0, "kv_cache": 0.7})


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """An autoscale block with every default resolved: the numbers the reconciler's policy runs on."""

    metric: str
    target: float
    scale_down_window: float
    fast_factor: float
    max_step: int
    tolerance: float


@dataclass(frozen=True, slots=True)
class Autoscale:
    """How a model's replica count follows its load between replicas.min and replicas.max, as written.

    Wanted = ceil(load / target), the load summed over the model's ready
    replicas; no step while the load per wanted replica is within `tolerance`
    of the target. Up: at most `max_step` replicas a step (replicas still
    starting count as capacity), unless the load per wanted replica is
    `fast_factor` times the target or more -- then straight to the count the
    load needs; a step is sized for the load grown over the model's measured
    cold start. Down: only to the highest count any pass of the last
    `scale_down_window` seconds needed, and at most `max_step` a step.
    `policy()` resolves the defaults; the policy math is
    llmgwctl.reconciler.autoscale.
    """

    metric: str = "inflight"
    # None: the metric's default from AUTOSCALE_METRICS (resolved by policy()).
    target: float | None = None
    # 5 min, as Kubernetes HPA's default downscale stabilization: a GPU
    # replica's cold start costs tens of seconds to minutes, so releasing it
    # for a lull shorter than that costs more than it saves.
    scale_down_window: float = 300.0
    # Twice the target per replica: even the doubled fleet would be at target,
    # so stepping by max_step would take several cold starts to catch up.
    fast_factor: float = 2.0
    # Two at a time: a model's load rarely jumps more than 2x between passes
    # unless the fast path says so, so a wrong signal costs two GPUs, not max.
    max_step: int = 2
    # 10 %, Kubernetes HPA's default: a load within a tenth of what the fleet
    # is sized for is noise around the target, and a step on it (a replica
    # bought for a burst, released a window later) is what flapping is.
    tolerance: float = 0.1

    def policy(self) -> ScalingPolicy:
        """The block with its defaults resolved; ValueError for a metric llmgw cannot read (validation says so first)."""
        if self.metric not in AUTOSCALE_METRICS:
            raise ValueError(f"{self.metric!r} is not one of {', '.join(AUTOSCALE_METRICS)}")
        target = AUTOSCALE_METRICS[self.metric] if self.target is None else self.target
        return ScalingPolicy(metric=self.metric, target=target, scale_down_window=self.scale_down_window,
                             fast_factor=self.fast_factor, max_step=self.max_step, tolerance=self.tolerance)

    def to_dict(self) -> dict[str, Any]:
        # The resolved target where the metric is known: `catalog show` says what is in force.
        target = self.policy().target if self.metric in AUTOSCALE_METRICS else self.target
        return {"metric": self.metric, "target": target,
                "scale_down_window": format_duration(self.scale_down_window),
                "fast_factor": self.fast_factor, "max_step": self.max_step, "tolerance": self.tolerance}


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
    # MiB this profile needs on each of its GPUs. None: it takes whole GPUs (no
    # one else shares them). Set: placement fits it into a GPU's free memory,
    # beside other replicas whose needs fit too.
    gpu_memory_mib: int | None = None
    # Nodes a replica spans (`gpus` on each) and its split across them as written: multinode.py.
    nodes: int = 1
    parallel: str | None = None

    @property
    def parallelism(self) -> str | None:
        return parallelism(self)        # the split with its default resolved; None on one node

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "engine": self.engine}
        if self.source is not None:
            out["source"] = self.source
        if self.pool is not None:
            out["pool"] = self.pool
        out.update(gpus=self.gpus, priority=self.priority, weight=self.weight)
        out.update(written(self))
        if self.gpu_memory_mib is not None:
            out["gpu_memory"] = format_size_mib(self.gpu_memory_mib)
        if self.args:
            out["args"] = list(self.args)
        if self.env:
            out["env"] = dict(self.env)
        return out


# What `lora:` defaults to when a model has adapters and does not say:
# - max_loras 4: vLLM's own default is 1, which makes every batch mixing two
#   adapters wait for a swap; each slot reserves max_rank-sized weights for
#   every layer on the GPU, so 4 stays a few hundred MiB on a 7B model.
# - max_rank 16: vLLM's default, and what PEFT's fine-tunes commonly use (8 or
#   16); a bigger adapter is refused by the engine with the reason, shown in status.
LORA_DEFAULTS = (4, 16)


@dataclass(frozen=True, slots=True)
class Lora:
    """How a base model's engines are started to serve adapters: slots on the GPU and the largest rank."""

    max_loras: int = LORA_DEFAULTS[0]
    max_rank: int = LORA_DEFAULTS[1]

    def to_dict(self) -> dict[str, Any]:
        return {"max_loras": self.max_loras, "max_rank": self.max_rank}


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter of a base model: a model name clients use, served by some of the base's replicas.

    `replicas` None means every replica of the base holds it; a number, that
    many (spread, at most as many as the base runs). `max_replicas` above
    `replicas` lets its own load spread it to more of them, up to that many,
    by `autoscale` (metric inflight: its requests in flight, as the routers
    count them per adapter; llmgwctl.reconciler.adapters); None: `replicas`
    is both floor and ceiling. `source` is what the engine loads: a
    directory on the node, a hub id, or pkg:PACKAGE/DIR.
    """

    name: str
    source: str
    aliases: tuple[str, ...] = ()
    replicas: int | None = None
    origin: Origin = field(default=Origin(), compare=False)
    max_replicas: int | None = None
    autoscale: Autoscale = Autoscale()

    @property
    def grows(self) -> bool:
        """Whether its load may spread it beyond its floor (`replicas: {min, max}` with max above min)."""
        return self.replicas is not None and self.max_replicas is not None and self.max_replicas > self.replicas

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.aliases:
            out["aliases"] = list(self.aliases)
        out["source"] = self.source
        if self.max_replicas is not None:
            out["replicas"] = {"min": self.replicas, "max": self.max_replicas}
            out["autoscale"] = self.autoscale.to_dict()
        else:
            out["replicas"] = "all" if self.replicas is None else self.replicas
        return out


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """What an adapter's name resolves to: the adapter and its base model."""

    adapter: Adapter
    base: Model


@dataclass(frozen=True, slots=True)
class Model:
    """A model operators want served, under its name and aliases.

    `profiles` keep the written order (so errors and `show` point where the
    operator wrote them); `ranked()` gives them best first, the order
    placement tries them in.
    `idle_timeout` is seconds without requests before scaling down to
    `replicas.min`; None means never. `priority` orders models against each
    other when GPUs are short: a model's minimum replicas may stop replicas
    of models with a lower priority to make room (equal priorities never
    preempt each other; the catalog order decides who gets free room first).
    """

    name: str
    profiles: tuple[Profile, ...]
    source: str = ""
    aliases: tuple[str, ...] = ()
    replicas: Replicas = Replicas()
    idle_timeout: float | None = None
    priority: int = 0
    origin: Origin = field(default=Origin(), compare=False)
    autoscale: Autoscale = Autoscale()
    # One of ROUTING_POLICIES; None: the router's default. Last, so the
    # fields before it keep their positions for callers that pass them so.
    routing: str | None = None
    # Hand-overs a cut chat stream may make to another replica (router/continuation.py);
    # 0: off, the default, since each re-sends the whole prompt (a second
    # prefill on another GPU) and the text is only as faithful as that
    # engine's continuation of it.
    continuation: int = 0
    # The context length /v1/models shows before any of its engines said
    # one (router/modelinfo.py: an engine's own word wins once it is heard);
    # None: unknown until then.
    context_length: int | None = None
    # Other models (names or aliases, as written) that answer for this one when
    # it has no replica that can (catalog/fallbacks.py checks them, the router's
    # router/fallback.py follows them); empty: none, the default.
    fallbacks: tuple[str, ...] = ()
    # LoRA adapters its replicas serve (see Adapter), and how its engines are
    # started for them; `lora` None with adapters means LORA_DEFAULTS.
    adapters: tuple[Adapter, ...] = ()
    lora: Lora | None = None

    @property
    def lora_slots(self) -> Lora | None:
        """The LoRA settings its engines start with; None when it serves no adapters (and says no `lora:`)."""
        if self.lora is not None:
            return self.lora
        return Lora() if self.adapters else None

    def ranked(self) -> tuple[Profile, ...]:
        """Profiles by priority, highest first; the written order breaks ties."""
        return tuple(sorted(self.profiles, key=lambda p: -p.priority))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.aliases:
            out["aliases"] = list(self.aliases)
        out["source"] = self.source
        out["replicas"] = self.replicas.to_yaml()
        if self.priority:
            out["priority"] = self.priority
        if self.idle_timeout is not None:
            out["idle_timeout"] = format_duration(self.idle_timeout)
        if self.autoscale != Autoscale():
            # Only when set: a catalog that does not mention autoscaling keeps its version.
            out["autoscale"] = self.autoscale.to_dict()
        out["profiles"] = [p.to_dict() for p in self.profiles]
        if self.routing is not None:
            # Only when written: a catalog without it keeps its version.
            out["routing"] = self.routing
        if self.continuation:
            out["continuation"] = (True if self.continuation == CONTINUATION_ATTEMPTS
                                   else {"attempts": self.continuation})
        if self.context_length is not None:
            # Only when written: a catalog without it keeps its version.
            out["context_length"] = self.context_length
        if self.fallbacks:
            # Only when written: a catalog without it keeps its version.
            out["fallbacks"] = list(self.fallbacks)
        if self.lora is not None:
            out["lora"] = self.lora.to_dict()
        if self.adapters:
            # Only when written: a catalog without adapters keeps its version.
            out["adapters"] = [a.to_dict() for a in self.adapters]
        return out


class Catalog:
    """The whole set of models llmgw should serve; valid by construction, never mutated.

    `resolve(name_or_alias)` is one dict lookup. `version` is a hash of the
    content (not of the files' bytes), so reformatting a file or editing a
    comment yields the same version and no swap.
    """

    __slots__ = ("_models", "_engines", "_index", "_adapters", "_version")

    def __init__(self, models: Iterable[Model] = (), engines: Mapping[str, EngineSpec] | None = None):
        models = tuple(models)
        all_engines = dict(BUILTIN_ENGINES)
        problems: list[Problem] = []
        for spec in (engines or {}).values():
            if spec.name in BUILTIN_ENGINES:
                problems.append(_at(spec.origin, (), f"redefines the built-in engine {spec.name!r}; choose another name"))
                continue
            problems.extend(_at(spec.origin, path, msg) for path, msg in check_engine(spec))
            all_engines[spec.name] = spec
        index: dict[str, Model] = {}
        adapters: dict[str, AdapterRef] = {}
        # name -> where it was first used, so the second use can point back at the first
        first_use: dict[str, tuple[str, tuple[str | int, ...], str]] = {}
        total = 0
        for model in models:
            problems.extend(check_model(model, all_engines))
            if isinstance(model.replicas.max, int) and not isinstance(model.replicas.max, bool):
                total += model.replicas.max
                if total > MAX_TOTAL_REPLICAS:
                    problems.append(_at(model.origin, ("replicas",), (
                        f"the catalog's models want more than {MAX_TOTAL_REPLICAS} replicas together "
                        f"(replicas.max summed up to here: {total}); lower some max")))
                    total = -(1 << 62)  # said once is enough
            for key, what, path, adapter in _names_of(model):
                path = model.origin.path + path
                if key in first_use:
                    file, first_path, first_what = first_use[key]
                    owner = (f"model {index[key].name!r}" if key in index else
                             f"adapter {adapters[key].adapter.name!r} of model {adapters[key].base.name!r}")
                    problems.append(Problem(
                        model.origin.file, path,
                        f"{what} {key!r} is already {first_what} of {owner} "
                        f"({file or 'same document'}: {format_path(first_path)}); "
                        "names and aliases must be unique across the whole catalog",
                    ))
                    continue
                first_use[key] = (model.origin.file, path, "the name" if what.endswith("name") else "an alias")
                if adapter is None:
                    index[key] = model
                else:
                    adapters[key] = AdapterRef(adapter, model)
        problems.extend(check_fallbacks(models, index))
        if problems:
            raise CatalogError(problems)
        self._models = models
        self._engines = MappingProxyType(all_engines)
        self._index = MappingProxyType(index)
        self._adapters = MappingProxyType(adapters)
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

    def adapter(self, name_or_alias: str) -> AdapterRef | None:
        """The adapter a client's model name names, with its base; None when it names none (one dict lookup)."""
        return self._adapters.get(name_or_alias)

    @property
    def has_adapters(self) -> bool:
        return bool(self._adapters)

    def names(self) -> tuple[str, ...]:
        """Every name and alias that resolves, adapters' too, for `/v1/models` and "did you mean"."""
        return tuple(self._index) + tuple(self._adapters)

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


def _names_of(model: Model) -> Iterator[tuple[str, str, tuple[str | int, ...], Adapter | None]]:
    yield model.name, "name", ("name",), None
    seen = {model.name}
    for i, alias in enumerate(model.aliases):
        # A repeat inside the model itself is reported once, by modelrules.check_model.
        if alias not in seen:
            seen.add(alias)
            yield alias, "alias", ("aliases", i), None
    for j, adapter in enumerate(model.adapters):
        yield adapter.name, "adapter name", ("adapters", j, "name"), adapter
        mine = {adapter.name}
        for i, alias in enumerate(adapter.aliases):
            if alias not in mine:
                mine.add(alias)
                yield alias, "adapter alias", ("adapters", j, "aliases", i), adapter
