"""`ReplicaSpec`, what an agent needs to run one replica; `LoadReading`, an engine's load as the router weighs it.

`ReplicaSpec` is self-contained (it carries a catalog-defined engine's command
template with it) because it travels from the controller to an agent that has
no catalog of its own. Its `spec_hash` covers everything that shapes the
process -- engine and its template, source, args, env, GPU count, and the
adapters of an engine that loads them only at launch (llama.cpp) -- and nothing
that does not (replica id, which GPU indices, port), so a controller that
restarts can adopt a running replica whose hash still matches and replace one
whose profile changed.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..catalog import EngineSpec, Model, Profile
from ..catalog.modelrules import LAUNCH_LORA_ENGINES
from .adapters import AdapterSpec, adapter_specs
from .group import GroupSlot, group_slot


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    id: str
    model: str              # the model's canonical name: what the engine serves it as
    profile: str
    engine: str
    source: str
    gpus: int
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    gpu_indices: tuple[int, ...] = ()
    # Only for catalog-defined engines; built-in drivers know their own.
    command: tuple[str, ...] = ()
    health: str = "/health"
    metrics: str | None = "/metrics"
    # MiB the profile declared per GPU (0: whole GPUs). In the hash: it shapes
    # the process (the engine is told how much of the GPU it may use).
    gpu_memory_mib: int = 0
    # That need as a fraction of the placed GPUs' total memory, chosen with the
    # GPUs (so, like gpu_indices, not in the hash); None for whole GPUs. The
    # vllm driver passes it as --gpu-memory-utilization.
    gpu_memory_share: float | None = None
    # LoRA: the engine's adapter slots and largest rank (0: started without
    # LoRA, or an engine that has no slots to size). In the hash: they are engine flags.
    lora_slots: int = 0
    lora_rank: int = 0
    # The adapters the controller placed on this replica (contracts.adapters).
    # Not in the hash where the agent loads and unloads them on the running
    # engine (vLLM); in it for an engine that loads them only at launch
    # (LAUNCH_LORA_ENGINES: llama.cpp), where they are part of the process.
    adapters: tuple[AdapterSpec, ...] = ()
    # Set for a member of a replica spanning nodes (contracts.group): its rank,
    # the group's size and how it is split, the head's address and ports. Its
    # size and parallel are in the hash; the rest placement chose.
    group: GroupSlot | None = None
    # `spec_hash`, computed on first use: the controller compares every desired
    # replica's hash on every pass, and a JSON dump + sha256 per replica per
    # pass was most of a pass over a big fleet. Not a field anything compares.
    _hash: str | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def for_profile(cls, replica_id: str, model: Model, profile: Profile, engine: EngineSpec,
                    gpu_indices: Sequence[int] = (), gpu_memory_share: float | None = None,
                    group: GroupSlot | None = None) -> ReplicaSpec:
        slots = model.lora_slots
        adapters: tuple[AdapterSpec, ...] = ()
        if profile.engine in LAUNCH_LORA_ENGINES:
            # Every adapter of the model, in catalog order (which is their ids
            # on the engine): it loads them at launch, and has no slots to size.
            slots, adapters = None, tuple(AdapterSpec(a.name, a.source) for a in model.adapters)
        return cls(
            group=group,
            gpu_memory_mib=profile.gpu_memory_mib or 0, gpu_memory_share=gpu_memory_share,
            id=replica_id, model=model.name, profile=profile.name, engine=profile.engine,
            source=profile.source or model.source or model.name, gpus=profile.gpus, args=tuple(profile.args),
            env=MappingProxyType(dict(profile.env)), gpu_indices=tuple(gpu_indices),
            command=tuple(engine.command), health=engine.health, metrics=engine.metrics,
            lora_slots=slots.max_loras if slots else 0, lora_rank=slots.max_rank if slots else 0,
            adapters=adapters,
        )

    @property
    def spec_hash(self) -> str:
        if self._hash is None:
            object.__setattr__(self, "_hash", self._compute_hash())   # frozen: set once, on first read
        return self._hash  # type: ignore[return-value]

    def _compute_hash(self) -> str:
        shape = {
            "model": self.model, "engine": self.engine, "source": self.source, "gpus": self.gpus,
            "args": list(self.args), "env": dict(sorted(self.env.items())),
            "command": list(self.command), "health": self.health, "metrics": self.metrics,
        }
        if self.gpu_memory_mib:
            # Only when set, so every replica without it keeps the hash it had
            # before the field existed and is adopted after an upgrade.
            shape["gpu_memory_mib"] = self.gpu_memory_mib
        if self.lora_slots:
            # The same: only a model with adapters has it.
            shape["lora"] = [self.lora_slots, self.lora_rank]
        if self.adapters and self.engine in LAUNCH_LORA_ENGINES:
            # The same: only a base whose engine loads its adapters at launch.
            shape["adapters"] = [[a.name, a.source] for a in self.adapters]
        if self.group is not None:
            # The same: only a member of a group spanning nodes has it.
            shape["group"] = [self.group.size, self.group.parallel]
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "model": self.model, "profile": self.profile, "engine": self.engine,
            "source": self.source, "gpus": self.gpus, "args": list(self.args), "env": dict(self.env),
            "gpu_indices": list(self.gpu_indices), "command": list(self.command),
            "health": self.health, "metrics": self.metrics, "spec_hash": self.spec_hash,
            "gpu_memory_mib": self.gpu_memory_mib, "gpu_memory_share": self.gpu_memory_share,
            **({"lora_slots": self.lora_slots, "lora_rank": self.lora_rank} if self.lora_slots else {}),
            **({"adapters": [a.to_dict() for a in self.adapters]} if self.adapters else {}),
            **({"group": self.group.to_dict()} if self.group is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaSpec:
        return cls(
            id=str(data["id"]), model=str(data["model"]), profile=str(data.get("profile", "")),
            engine=str(data["engine"]), source=str(data.get("source") or data["model"]),
            gpus=int(data.get("gpus", 0)), args=tuple(str(a) for a in data.get("args", ())),
            env=MappingProxyType({str(k): str(v) for k, v in (data.get("env") or {}).items()}),
            gpu_indices=tuple(int(i) for i in data.get("gpu_indices", ())),
            command=tuple(str(c) for c in data.get("command", ())),
            health=str(data.get("health", "/health")), metrics=data.get("metrics", "/metrics"),
            gpu_memory_mib=int(data.get("gpu_memory_mib") or 0),
            gpu_memory_share=None if data.get("gpu_memory_share") is None else float(data["gpu_memory_share"]),
            lora_slots=int(data.get("lora_slots") or 0), lora_rank=int(data.get("lora_rank") or 0),
            adapters=adapter_specs(data.get("adapters")),
            group=group_slot(data.get("group")),
        )


@dataclass(frozen=True, slots=True)
class LoadReading:
    """One engine's load from its /metrics: what the router weighs endpoints by.

    `kv_cache` is 0-1, or None when the engine does not report it (llama.cpp).
    `cache_tokens` is how many tokens the engine's KV cache holds in all, when
    it says (vLLM's `cache_config_info`): what the router's prefix index
    sizes itself by.
    """

    running: float
    waiting: float
    kv_cache: float | None = None
    cache_tokens: int | None = None
