"""The rules one model keeps on its own: its aliases, routing policy, profiles, env and LoRA adapters.

`check_model(model, engines)` is what `Catalog` runs on each model, beside
`bounds.check_numbers` (its numbers) and before the rules across models
(names unique across the catalog, `fallbacks`). Kept apart from `model` so
the data classes read on their own; like `bounds`, it imports the model's
types only to name them, and `model` takes the constants it re-exports
(ROUTING_POLICIES, LORA_ENGINES) from here.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from .bounds import MAX_REPLICAS, check_autoscale, check_numbers
from .engine_env import env_refusal
from .errors import Problem
from .multinode import check_multinode

if TYPE_CHECKING:
    from .model import Adapter, EngineSpec, Model, Profile

# How the router picks among a model's replicas: the labels of
# llmgwctl.router.policies.Policy, the registry that implements them, which
# this layer cannot import; tests/router/policies/test_registry.py holds this
# tuple and the schema's enum to it. None in a Model means the router's default.
ROUTING_POLICIES = ("round-robin", "least-load", "prefix", "session")
# Engines whose replicas can serve LoRA adapters beside their base model:
# vLLM loads and unloads them at run time (--enable-lora and its
# /v1/load_lora_adapter route), and the fake engine mimics it. llama.cpp's
# server loads them only at launch (--lora), then picks one per request (the
# body's `lora` member, which the router writes).
LORA_ENGINES = ("vllm", "fake", "llamacpp")
# Of those, the engines that load adapters only at launch: a replica's
# adapters are then part of what its process is (contracts.ReplicaSpec's
# hash), so an adapter edit replaces the replica, surge first, as a profile
# edit does. Each of their replicas holds every adapter of its model: a
# spread (`replicas: N`) would make two replicas of one profile two
# different processes, which a profile's one spec hash cannot say.
LAUNCH_LORA_ENGINES = ("llamacpp",)
# What status and `catalog apply` say of such a replica when its adapters changed.
LAUNCH_LORA_REASON = "llama.cpp loads adapters only at launch: the replica is replaced"
# Bounds: vLLM allocates max_loras x max_rank per layer up front, so a typo
# of 10,000 slots is an engine that never starts; 256 slots and rank 512 are
# past what any GPU's memory holds for a real model.
MAX_LORA_SLOTS = 256
# vLLM takes only these ranks for --max-lora-rank (its LoRAConfig's list).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapters one model may name: each is a load call per replica per change, and
# a name in the router's index.
MAX_ADAPTERS = 1000


def check_model(model: Model, engines: Mapping[str, EngineSpec]) -> Iterable[Problem]:
    """Every problem `model` has on its own, located in its document; `engines` are the ones the catalog knows."""
    file, base = model.origin.file, model.origin.path
    for path, message in check_numbers(model):
        yield Problem(file, base + path, message)
    if isinstance(model.replicas.min, int) and isinstance(model.replicas.max, int) \
            and model.replicas.min > model.replicas.max:
        yield Problem(file, base + ("replicas",), f"min ({model.replicas.min}) is greater than max ({model.replicas.max})")
    for i, message in _alias_repeats(model.name, model.aliases, "model"):
        yield Problem(file, base + ("aliases", i), message)
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
        for path, message in check_multinode(profile):
            yield Problem(file, base + ("profiles", i) + path, message)
    for path, message in _check_lora(model):
        yield Problem(file, base + path, message)


def _check_lora(model: Model) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """Adapters only on a base whose every profile can serve them, with bounded slots, ranks and counts."""
    if model.lora is not None:
        if not (isinstance(model.lora.max_loras, int) and 1 <= model.lora.max_loras <= MAX_LORA_SLOTS):
            yield ("lora", "max_loras"), f"expected an integer from 1 to {MAX_LORA_SLOTS}, got {model.lora.max_loras!r}"
        if model.lora.max_rank not in LORA_RANKS or isinstance(model.lora.max_rank, bool):
            yield ("lora", "max_rank"), (f"{model.lora.max_rank!r} is not a rank vLLM takes "
                                         f"({', '.join(map(str, LORA_RANKS))})")
    if model.lora_slots is None:
        return
    if len(model.adapters) > MAX_ADAPTERS:
        yield ("adapters",), f"has {len(model.adapters)} adapters; at most {MAX_ADAPTERS} per model"
    for i, profile in enumerate(model.profiles):
        if profile.engine not in LORA_ENGINES:
            yield ("profiles", i, "engine"), (
                f"engine {profile.engine!r} cannot serve LoRA adapters, which this model has "
                f"(engines that can: {', '.join(LORA_ENGINES)}); give the adapters a base whose profiles all can")
    at_launch = next((p.engine for p in model.profiles if p.engine in LAUNCH_LORA_ENGINES), None)
    if at_launch is not None and model.adapters:
        yield from _check_launch_lora(model, at_launch)
    for j, adapter in enumerate(model.adapters):
        if adapter.replicas is not None and (isinstance(adapter.replicas, bool) or not isinstance(adapter.replicas, int)
                                             or not 1 <= adapter.replicas <= MAX_REPLICAS):
            yield ("adapters", j, "replicas"), f"expected all or an integer from 1 to {MAX_REPLICAS}, got {adapter.replicas!r}"
        yield from _check_spread(adapter, ("adapters", j))
        for i, message in _alias_repeats(adapter.name, adapter.aliases, "adapter"):
            yield ("adapters", j, "aliases", i), message


def _check_launch_lora(model: Model, engine: str) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """A base whose engine loads adapters at launch (llama.cpp): GGUF adapter files, on every replica, no vLLM beside it.

    llama-server's --lora takes a GGUF LoRA file (what llama.cpp's
    convert_lora_to_gguf.py writes from a PEFT directory), never a hub id;
    vLLM takes the PEFT directory, so one adapter's source cannot serve both.
    """
    for i, profile in enumerate(model.profiles):
        if profile.engine == "vllm":
            yield ("profiles", i, "engine"), (
                f"a model with adapters cannot have both {engine} and vllm profiles: {engine} loads an adapter "
                "from a GGUF file, vLLM from a PEFT directory, and an adapter has one source")
    for j, adapter in enumerate(model.adapters):
        source = adapter.source
        if not (source.lower().endswith(".gguf") and (source.startswith(("pkg:", "/", ".", "~")))):
            yield ("adapters", j, "source"), (
                f"{source!r}: a {engine} base loads an adapter from a GGUF LoRA file: a path on the node "
                "ending in .gguf (starting with /, . or ~) or pkg:PACKAGE/FILE.gguf "
                "(convert a PEFT adapter with llama.cpp's convert_lora_to_gguf.py)")
        if adapter.replicas is not None:
            yield ("adapters", j, "replicas"), (
                f"{engine} loads adapters only at launch, so each replica of its base holds every adapter: "
                "remove replicas (or write all)")


def _check_spread(adapter: Adapter, at: tuple[str | int, ...]) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """An adapter that may grow: a ceiling at or above its floor, and a policy on its in-flight requests.

    Only `inflight`: the routers count an adapter's requests, but an engine's
    queue and KV cache are its base's, shared by every adapter on it.
    """
    from .model import Autoscale  # at call time: `model` imports this module
    if adapter.max_replicas is None:
        if adapter.autoscale != Autoscale():
            yield (*at, "autoscale"), ("an adapter scales only between replicas {min, max}; write replicas as "
                                       "{min: N, max: M} or remove autoscale")
        return
    floor, ceiling = adapter.replicas, adapter.max_replicas
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or not 1 <= ceiling <= MAX_REPLICAS:
        yield (*at, "replicas", "max"), f"expected an integer from 1 to {MAX_REPLICAS}, got {ceiling!r}"
    elif isinstance(floor, int) and ceiling < floor:
        yield (*at, "replicas", "max"), f"max {ceiling} is below min {floor}"
    if adapter.autoscale.metric != "inflight":
        yield (*at, "autoscale", "metric"), (f"an adapter scales on inflight only, not {adapter.autoscale.metric!r}: "
                                             "the engine's queue and KV cache are its base's, shared by its adapters")
        return
    for path, message in check_autoscale(adapter.autoscale):
        yield (*at, *path), message


def _check_env(profile: Profile) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """No env key that loads code into the engine (engine_env.py): the catalog describes models, not node code."""
    for key in profile.env:
        why = env_refusal(key)
        if why:
            yield ("env", key), why


def _alias_repeats(name: str, aliases: tuple[str, ...], whose: str) -> Iterable[tuple[int, str]]:
    """Aliases (by index) that repeat the model's or adapter's own name, or an alias before them."""
    listed: set[str] = set()   # a set: `in aliases[:i]` was quadratic in a model's aliases
    for i, alias in enumerate(aliases):
        if alias == name:
            yield i, f"alias {alias!r} repeats the {whose}'s own name; remove it"
        elif alias in listed:
            yield i, f"alias {alias!r} is listed twice"
        listed.add(alias)
