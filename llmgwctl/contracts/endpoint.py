"""`Endpoint`: one ready replica as the router sees it -- where it listens and how much traffic it should get.

This is the whole of what the router is told about a replica, and it lives
with the contracts, not in the router, so the reconciler that builds these
never loads the router's package (aiohttp and the server come with it). The
router must not know how the replica was placed or started: the controller (or
a static file, or the watch stream) builds these and pushes the complete list.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .errors import EndpointError

_NO_IDS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Endpoint:
    replica_id: str         # unique and never reused: usage is reported under it
    model: str              # the model's canonical name, which is also what the engine serves
    profile: str            # the catalog profile this replica runs, for cold-start decisions
    engine: str             # which metrics adapter reads its /metrics
    url: str                # "http://host:port", no trailing slash
    priority: int = 0       # higher tiers take traffic first while they have capacity
    weight: float = 1.0     # relative share of traffic at equal load
    metrics_path: str | None = "/metrics"   # None: the engine exposes no load gauges
    # LoRA adapters this replica serves now (loaded, and still placed here):
    # the router sends an adapter's requests only to endpoints listing it.
    adapters: frozenset[str] = frozenset()
    # For an engine that takes the adapter in each request by number
    # (llama.cpp's `lora` member): each served adapter's number, as the
    # engine listed it. Empty for the others, which take the adapter's name.
    adapter_ids: Mapping[str, int] = field(default_factory=lambda: _NO_IDS)

    def __post_init__(self) -> None:
        problems = []
        if not self.replica_id:
            problems.append("replica_id must not be empty")
        if not self.model:
            problems.append("model must not be empty")
        if not (self.url.startswith("http://") or self.url.startswith("https://")) or self.url.endswith("/"):
            problems.append(f"url must look like http://host:port without a trailing '/', got {self.url!r}")
        if not self.weight > 0:
            problems.append(f"weight must be greater than 0, got {self.weight!r}")
        if self.metrics_path is not None and not self.metrics_path.startswith("/"):
            problems.append(f"metrics_path must start with '/', got {self.metrics_path!r}")
        if any(name not in self.adapters for name in self.adapter_ids):
            problems.append(f"adapter_ids names adapters it does not serve: {sorted(set(self.adapter_ids) - self.adapters)}")
        if problems:
            raise EndpointError(f"endpoint {self.replica_id or '?'}: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "model": self.model, "profile": self.profile,
                "engine": self.engine, "url": self.url, "priority": self.priority,
                "weight": self.weight, "metrics_path": self.metrics_path,
                **({"adapters": sorted(self.adapters)} if self.adapters else {}),
                **({"adapter_ids": dict(sorted(self.adapter_ids.items()))} if self.adapter_ids else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Endpoint:
        """The inverse of `to_dict`; EndpointError naming the field when one is missing or mistyped."""
        try:
            return cls(
                replica_id=str(data["replica_id"]), model=str(data["model"]),
                profile=str(data.get("profile") or ""), engine=str(data.get("engine") or ""),
                url=str(data["url"]), priority=int(data.get("priority", 0)),
                weight=float(data.get("weight", 1.0)),
                metrics_path=data.get("metrics_path", "/metrics"),
                adapters=_names(data.get("adapters")),
                adapter_ids=_ids(data.get("adapter_ids")),
            )
        except KeyError as exc:
            raise EndpointError(f"endpoint {dict(data)!r}: missing field {exc.args[0]!r}") from None
        except EndpointError:
            raise
        except (TypeError, ValueError) as exc:
            raise EndpointError(f"endpoint {dict(data)!r}: {exc}") from None


def _ids(raw: Any) -> Mapping[str, int]:
    if not raw:
        return _NO_IDS
    if not isinstance(raw, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in raw.items()):
        raise TypeError(f"adapter_ids must map adapter names to engine ids, got {raw!r}")
    return MappingProxyType(dict(raw))


def _names(raw: Any) -> frozenset[str]:
    if not raw:
        return frozenset()
    if not isinstance(raw, (list, tuple)) or not all(isinstance(n, str) for n in raw):
        raise TypeError(f"adapters must be a list of names, got {raw!r}")
    return frozenset(raw)
