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
import math
import re
import string
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from .durations import format_duration
from .sizes import format_size_mib
from .engine_env import env_refusal
from .errors import CatalogError, Problem, format_path

API_VERSION = "llmgw/v1"
KIND = "Catalog"

# Placeholders an engine command template may use; anything else in braces is a
# typo that would otherwise reach the engine's command line verbatim.
TEMPLATE_FIELDS = frozenset({"source", "port", "host", "model", "gpus"})
# Programs whose `-c STRING` is shell code. A placeholder there is filled
# shlex-quoted (llmgwctl.engines.custom), since `source: "x; touch INJECTED #"`
# would otherwise run as a second command; everywhere else a placeholder only
# ever fills one argv element, which no shell reads.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox"})
# Engine routes that change the engine for every client -- loading adapters,
# sleeping, shutting down, dropping caches, profiling, swapping weights --
# which an engine's `routes` may never name: the router never proxies them
# (router.routes), and the catalog must not open them either. Matched on any
# path segment, so `/v1/load_lora_adapter` and a future `/v2/sleep` both are.
ADMIN_ROUTE_WORDS = ("lora", "adapter", "sleep", "wake", "shutdown", "reset", "flush", "cache", "profile",
                     "weights", "collective_rpc", "rpc", "abort", "pause", "resume", "scale", "slots",
                     "memory_occupation", "configure", "debug", "admin", "expert_distribution", "kill")
# Client routes an engine may add: under /v1/ (where the router proxies), a
# few plain segments, nothing the router answers itself.
ENGINE_ROUTE = re.compile(r"/v1(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}){1,4}")


def shell_strings(command: Iterable[str]) -> frozenset[int]:
    """Indexes of the elements of `command` that a shell runs as code: what follows `-c` (or `-ec`, `-lc`...) after a shell."""
    command = list(command)
    out: set[int] = set()
    shell_at = None
    for i, part in enumerate(command):
        if shell_at is None:
            if part.rsplit("/", 1)[-1] in SHELLS:
                shell_at = i
            continue
        if part.startswith("-") and not part.startswith("--") and "c" in part[1:] and i + 1 < len(command):
            out.add(i + 1)
            shell_at = None
    return frozenset(out)


def _quoted_fields(part: str) -> list[str]:
    """Placeholders of a shell string that sit inside quotes, where a shlex-quoted value would break out again."""
    out, state, escaped = [], None, False
    for literal, name, _, _ in string.Formatter().parse(part):
        for ch in literal:
            if escaped:
                escaped = False
            elif state == "'":
                state = None if ch == "'" else state
            elif ch == "\\":
                escaped = True
            elif state == '"':
                state = None if ch == '"' else state
            elif ch in "'\"":
                state = ch
        if name is not None and state is not None:
            out.append(name)
    return out

# Bounds on every number a catalog holds. The catalog repository is trusted to
# describe the fleet, not to crash it: placement and the reconciler do work per
# wanted replica, so an unbounded count is unbounded work on the event loop.
# They are repeated in schemas/catalog.schema.json (editors show them); these
# are what holds when a Catalog is built in code.
#
# 1000 replicas of one model need at least 1000 GPUs (500 H100 boxes of 8 is a
# big fleet for one gateway), and a reconcile pass over 1000 wanted replicas
# takes milliseconds; past that the number is a typo, not a plan.
MAX_REPLICAS = 1000
# ...and the whole catalog wants at most this many: 1000 models scaling to 100
# each. It bounds a pass's work however many files a catalog is split into.
MAX_TOTAL_REPLICAS = 100_000
# The widest GPU count one replica spans: tensor parallelism across 8 nodes of 8.
MAX_GPUS = 64
# Weights are ratios between profiles; a million to one is already "never the
# other", and a bound keeps sums of weights far from float overflow.
MAX_WEIGHT = 1e6
# Priorities only order profiles; ±1e6 leaves room for any numbering scheme and
# stays exact in every int and float a metric or JSON reader uses.
PRIORITY_RANGE = (-1_000_000, 1_000_000)
# The most memory a profile may ask for per GPU: 1 TiB. The largest GPUs
# today hold under 300 GB, so this leaves room for generations to come and
# keeps sums of needs across a node's GPUs exact in every int.
MAX_GPU_MEMORY_MIB = 1 << 20
# An idle timeout past a year is "never" (write null), and a bound keeps clock
# arithmetic (now + timeout) exact in floats.
MAX_IDLE_TIMEOUT = 365 * 86400.0
# --- autoscale bounds ---
# A target is per replica: a million requests in flight or waiting on one
# replica is past any engine's batch (vLLM's max_num_seqs caps at thousands);
# KV-cache use is a fraction, so its target is (0, 1].
MAX_AUTOSCALE_TARGET = 1e6
# The stable window bounds how long load history is kept per model (one
# sample a pass); a day is past any diurnal lull worth holding replicas for.
MAX_SCALE_DOWN_WINDOW = 86400.0
# The fast path's factor: 1000x the target per replica is "always"; below 1 it
# would be below the target itself, where the normal path already steps.
FAST_FACTOR_RANGE = (1.0, 1000.0)
# The tolerance band: past half the target a band would let a fleet run at
# 1.5x its target (or half of it) without a step, which is no policy at all.
TOLERANCE_RANGE = (0.0, 0.5)
# --- end autoscale bounds ---
# How the router picks among a model's replicas: the labels of
# llmgwctl.router.policies.Policy, the registry that implements them, which
# this layer cannot import; tests/router/policies/test_registry.py holds this
# tuple and the schema's enum to it. None in a Model means the router's default.
ROUTING_POLICIES = ("round-robin", "least-load", "prefix", "session")


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

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "engine": self.engine}
        if self.source is not None:
            out["source"] = self.source
        if self.pool is not None:
            out["pool"] = self.pool
        out.update(gpus=self.gpus, priority=self.priority, weight=self.weight)
        if self.gpu_memory_mib is not None:
            out["gpu_memory"] = format_size_mib(self.gpu_memory_mib)
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
        total = 0
        for model in models:
            problems.extend(_check_model(model, all_engines))
            if isinstance(model.replicas.max, int) and not isinstance(model.replicas.max, bool):
                total += model.replicas.max
                if total > MAX_TOTAL_REPLICAS:
                    problems.append(_at(model.origin, ("replicas",), (
                        f"the catalog's models want more than {MAX_TOTAL_REPLICAS} replicas together "
                        f"(replicas.max summed up to here: {total}); lower some max")))
                    total = -(1 << 62)  # said once is enough
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
    seen = {model.name}
    for i, alias in enumerate(model.aliases):
        # A repeat inside the model itself is reported once, by _check_model.
        if alias not in seen:
            seen.add(alias)
            yield alias, "alias", ("aliases", i)


def _bounded(value: object, low: float, high: float, *, integer: bool = False) -> str | None:
    """Why `value` is not a number in [low, high] (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        return f"expected {'an integer' if integer else 'a number'} from {low:g} to {high:g}, got {type(value).__name__}"
    if not math.isfinite(value):
        return f"expected a finite number from {low:g} to {high:g}, got {value}"
    if not low <= value <= high:
        return f"expected a number from {low:g} to {high:g}, got {value:g}" if isinstance(value, float) else \
            f"expected a number from {low:g} to {high:g}, got {value}"
    return None


def _check_numbers(model: Model) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """Every number of a model finite and in range, so no later pass can overflow or loop on it."""
    for key in ("min", "max"):
        why = _bounded(getattr(model.replicas, key), 0, MAX_REPLICAS, integer=True)
        if why:
            yield ("replicas", key) if model.replicas.min != model.replicas.max else ("replicas",), \
                why + f" (at most {MAX_REPLICAS} replicas of one model)"
            break
    if model.idle_timeout is not None:
        why = _bounded(model.idle_timeout, 0, MAX_IDLE_TIMEOUT)
        if why:
            yield ("idle_timeout",), why.replace(f"{MAX_IDLE_TIMEOUT:g}", "31536000 (365d)") + \
                " seconds; omit it or write null to never scale down"
    yield from _check_autoscale(model.autoscale)
    why = _bounded(model.priority, *PRIORITY_RANGE, integer=True)
    if why:
        yield ("priority",), why
    for i, profile in enumerate(model.profiles):
        if profile.gpu_memory_mib is not None:
            why = _bounded(profile.gpu_memory_mib, 1, MAX_GPU_MEMORY_MIB, integer=True)
            if why:
                yield ("profiles", i, "gpu_memory"), why.replace(f"{MAX_GPU_MEMORY_MIB:g}", "1048576 (1TiB)") + " MiB"
            elif profile.gpus == 0:
                yield ("profiles", i, "gpu_memory"), ("a profile with gpus: 0 uses no GPU memory; "
                                                      "remove gpu_memory or give it gpus")
        for key, low, high, integer in (("gpus", 0, MAX_GPUS, True), ("priority", *PRIORITY_RANGE, True),
                                        ("weight", 0, MAX_WEIGHT, False)):
            value = getattr(profile, key)
            why = _bounded(value, low, high, integer=integer)
            if why is None and key == "weight" and value <= 0:
                why = f"expected a number greater than 0, got {value:g}"
            if why:
                yield ("profiles", i, key), why


def _check_autoscale(policy: Autoscale) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """The autoscale block's numbers finite and bounded, and its metric one llmgw can read."""
    if policy.metric not in AUTOSCALE_METRICS:
        yield ("autoscale", "metric"), f"{policy.metric!r} is not one of {', '.join(AUTOSCALE_METRICS)}"
        return
    high = 1.0 if policy.metric == "kv_cache" else MAX_AUTOSCALE_TARGET
    target = policy.policy().target
    why = _bounded(target, 0, high)
    if why is None and target <= 0:
        why = f"expected a number greater than 0, got {target:g}"
    if why:
        yield ("autoscale", "target"), why + (" (KV-cache use is a fraction of the cache)" if high == 1.0 else "")
    why = _bounded(policy.scale_down_window, 0, MAX_SCALE_DOWN_WINDOW)
    if why:
        yield ("autoscale", "scale_down_window"), why + " seconds (at most 1d)"
    why = _bounded(policy.fast_factor, *FAST_FACTOR_RANGE)
    if why:
        yield ("autoscale", "fast_factor"), why
    why = _bounded(policy.max_step, 1, MAX_REPLICAS, integer=True)
    if why:
        yield ("autoscale", "max_step"), why
    why = _bounded(policy.tolerance, *TOLERANCE_RANGE)
    if why:
        yield ("autoscale", "tolerance"), why


def _check_model(model: Model, engines: Mapping[str, EngineSpec]) -> Iterable[Problem]:
    file, base = model.origin.file, model.origin.path
    for path, message in _check_numbers(model):
        yield Problem(file, base + path, message)
    if isinstance(model.replicas.min, int) and isinstance(model.replicas.max, int) \
            and model.replicas.min > model.replicas.max:
        yield Problem(file, base + ("replicas",), f"min ({model.replicas.min}) is greater than max ({model.replicas.max})")
    listed: set[str] = set()   # a set: `in aliases[:i]` was quadratic in a model's aliases
    for i, alias in enumerate(model.aliases):
        if alias == model.name:
            yield Problem(file, base + ("aliases", i), f"alias {alias!r} repeats the model's own name; remove it")
        elif alias in listed:
            yield Problem(file, base + ("aliases", i), f"alias {alias!r} is listed twice")
        listed.add(alias)
    if model.routing is not None and model.routing not in ROUTING_POLICIES:
        yield Problem(file, base + ("routing",),
                      f"{model.routing!r} is not one of {', '.join(ROUTING_POLICIES)}")
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
        for path, message in _check_env(profile):
            yield Problem(file, base + ("profiles", i) + path, message)


def _check_env(profile: Profile) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """No env key that loads code into the engine (engine_env.py): the catalog describes models, not node code."""
    for key in profile.env:
        why = env_refusal(key)
        if why:
            yield ("env", key), why


def _check_engine(spec: EngineSpec) -> Iterable[tuple[tuple[str | int, ...], str]]:
    if not spec.command:
        yield ("command",), "a catalog-defined engine needs a command"
    shells = shell_strings(spec.command)   # once: per element it was quadratic in the command's length
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
        elif i in shells:
            quoted = _quoted_fields(part)
            if quoted:
                yield ("command", i), (f"placeholder {{{quoted[0]}}} is inside quotes in a shell string; write it "
                                       "bare: llmgw fills it shell-quoted, and a quote around that would undo it")
    for key in ("health", "metrics"):
        value = getattr(spec, key)
        if value is not None and not value.startswith("/"):
            yield (key,), f"expected a path starting with '/', got {value!r}"
    for i, route in enumerate(spec.routes):
        problem = engine_route_problem(route)
        if problem is not None:
            yield ("routes", i), problem


def engine_route_problem(route: str) -> str | None:
    """Why `route` cannot be a client route of an engine (see ENGINE_ROUTE, ADMIN_ROUTE_WORDS), or None."""
    if not ENGINE_ROUTE.fullmatch(route):
        return (f"{route[:100]!r} is not a client route: expected a path under /v1/ of plain segments "
                "(letters, digits, . _ -), such as /v1/score")
    segments = route.lower().split("/")[2:]
    if segments[0] == "models":
        return f"{route!r} is the router's own (GET /v1/models lists the catalog)"
    for word in ADMIN_ROUTE_WORDS:
        if any(word in seg for seg in segments):
            return (f"{route!r} looks like an engine-admin route ({word!r}): those change the engine for "
                    "every client, and clients never reach them")
    return None

