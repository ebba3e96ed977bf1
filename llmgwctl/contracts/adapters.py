"""LoRA adapters on a replica: which the controller wants there (`AdapterSpec`) and how each stands (`AdapterStatus`).

An adapter is desired state like a replica: the controller places it on some
of its base's replicas and says so in each replica's spec (`ReplicaSpec.adapters`,
outside the spec hash, so a change loads or unloads it without restarting the
engine; inside it for an engine that loads adapters only at launch, llama.cpp,
whose replica is replaced instead); the agent loads and unloads it on the
engine and reports each one's state in the replica's report; the router sends
an adapter's requests only to replicas whose report says it is loaded and
whose spec still wants it.

    AdapterSpec    name (what the engine serves it as), source (what it loads)
    AdapterStatus  name, state (loading, loaded, failed, unloading), reason (the engine's, when it failed),
                   engine_id (llama.cpp's number for it, which a request names it by; None elsewhere)
    AdapterSpread  per adapter of a model, for status: how many of the base's replicas hold it and why
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..catalog.modelrules import MAX_ADAPTERS

_T = TypeVar("_T")

# What an agent reports of an adapter. `loading` also covers waiting for the
# engine to be ready; `failed` waits out a back-off before the next try.
LOADING, LOADED, FAILED, UNLOADING = "loading", "loaded", "failed", "unloading"
ADAPTER_STATES = (LOADING, LOADED, FAILED, UNLOADING)
# A reason is the engine's error text, cut: what a report and a status line carry.
MAX_ADAPTER_REASON = 1024
# An engine's number for an adapter is its place among the model's adapters,
# which the catalog bounds.
MAX_ENGINE_ID = MAX_ADAPTERS


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterSpec:
        name, source = data["name"], data.get("source") or data["name"]
        if not isinstance(name, str) or not name or not isinstance(source, str):
            raise ValueError(f"adapter {dict(data)!r}: name and source must be strings")
        return cls(name, source)


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    name: str
    state: str
    reason: str = ""
    # The engine's own number for a loaded adapter, where a request selects
    # its adapter by number (llama.cpp's `lora` member); as the engine
    # listed it, never derived from launch order.
    engine_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "state": self.state}
        if self.reason:
            out["reason"] = self.reason[:MAX_ADAPTER_REASON]
        if self.engine_id is not None:
            out["engine_id"] = self.engine_id
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterStatus:
        name, state = data.get("name"), data.get("state")
        if not isinstance(name, str) or not name or state not in ADAPTER_STATES:
            raise ValueError(f"adapter status {dict(data)!r}: needs a name and a state of {', '.join(ADAPTER_STATES)}")
        engine_id = data.get("engine_id")
        if engine_id is not None and (type(engine_id) is not int or not 0 <= engine_id < MAX_ENGINE_ID):
            raise ValueError(f"adapter status {dict(data)!r}: engine_id must be an integer from 0 to {MAX_ENGINE_ID - 1}")
        return cls(name, str(state), str(data.get("reason") or "")[:MAX_ADAPTER_REASON], engine_id)


@dataclass(frozen=True, slots=True)
class AdapterSpread:
    """One adapter's spread over its base's replicas as the controller placed it, for status.

    `holders` of `of` replicas that serve (ready or starting); `load` the
    in-flight requests its spread was last decided on (None: it does not
    grow with load, or no reading yet) against `target` per holder;
    `floor` and `ceiling` from the catalog (`ceiling` None: every replica).
    """

    name: str
    holders: int
    of: int
    floor: int | None = None
    ceiling: int | None = None
    load: float | None = None
    target: float | None = None

    def why(self) -> str:
        """The status line's reason, e.g. "spread to 3 of 4 replicas: 9.5 in flight against a target of 4"."""
        where = f"{self.holders} of {self.of} replica{'s' if self.of != 1 else ''}"
        if self.ceiling is None:
            return f"on {where}: replicas all" if self.floor is None else f"on {where}: replicas {self.floor}"
        if self.load is None:
            return f"on {where}: no load measured yet (min {self.floor}, max {self.ceiling})"
        verb = "spread to" if self.floor is not None and self.holders > self.floor else "on"
        return (f"{verb} {where}: {self.load:.3g} in flight against a target of {self.target:g}"
                f" (min {self.floor}, max {self.ceiling})")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "holders": self.holders, "of": self.of, "min": self.floor, "max": self.ceiling,
                "load": self.load, "target": self.target, "reason": self.why()}


def adapter_specs(raw: Any) -> tuple[AdapterSpec, ...]:
    """A desired replica's `adapters`, as the controller sent them."""
    return _listed(raw, AdapterSpec.from_dict)


def adapter_statuses(raw: Any) -> tuple[AdapterStatus, ...]:
    """A reported replica's `adapters`, as its agent sent them."""
    return _listed(raw, AdapterStatus.from_dict)


def _listed(raw: Any, parse: Callable[[Mapping[str, Any]], _T]) -> tuple[_T, ...]:
    """A document's `adapters` list, each entry through `parse`; absent or empty: none. ValueError for any other shape."""
    if not raw:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"adapters must be a list, got {type(raw).__name__}")
    return tuple(parse(a) for a in raw)
