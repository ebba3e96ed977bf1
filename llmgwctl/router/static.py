"""The static endpoint file: a router with no control plane (`llmgwctl router --endpoints FILE --catalogs DIR`).

Owns reading and checking that file. Format (YAML):

    endpoints:
      - model: qwen                  # required: a model name or alias in the catalog
        url: http://10.0.0.5:8000    # required: where the engine listens
        profile: h100                # optional: the model's best profile (first by priority)
        id: gpu5-qwen                # optional: "<model>@<host:port>"; must be unique
        priority: 10                 # optional: the profile's priority
        weight: 2                    # optional: the profile's weight
        engine: vllm                 # optional: the profile's engine (which /metrics adapter reads it)
        metrics_path: /metrics       # optional: the engine's (null: do not poll this endpoint)

Defaults come from the catalog so the file only says where engines listen; the
catalog stays the one place that says how models rank. Every problem in the
file is reported at once, each as `FILE: endpoints[i].field: what is wrong`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..catalog import Catalog
from ..contracts import Endpoint
from .errors import RouterError
from .upstream import BadEndpointURL, parse_target
from .yamlfile import load_yaml

_FIELDS = {"model", "url", "profile", "id", "priority", "weight", "engine", "metrics_path"}


class EndpointFileError(RouterError):
    """The endpoint file cannot be used; the message lists every problem, one per line."""


def load_endpoints(path: str | Path, catalog: Catalog) -> list[Endpoint]:
    return parse_endpoints(load_yaml(path, EndpointFileError), catalog, str(path))


def parse_endpoints(doc: Any, catalog: Catalog, source: str = "<endpoints>") -> list[Endpoint]:
    if not isinstance(doc, dict) or not isinstance(doc.get("endpoints"), list):
        raise EndpointFileError(f"{source}: expected a mapping with an 'endpoints' list, "
                                "e.g. endpoints: [{model: qwen, url: 'http://127.0.0.1:8000'}]")
    problems: list[str] = []
    out: list[Endpoint] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(doc["endpoints"]):
        where = f"{source}: endpoints[{i}]"
        if not isinstance(raw, dict):
            problems.append(f"{where}: expected a mapping with at least model and url")
            continue
        unknown = sorted(set(raw) - _FIELDS)
        if unknown:
            problems.append(f"{where}: unknown field {unknown[0]!r}; expected some of {', '.join(sorted(_FIELDS))}")
            continue
        missing = [f for f in ("model", "url") if not raw.get(f)]
        if missing:
            problems.append(f"{where}.{missing[0]}: required")
            continue
        model = catalog.resolve(str(raw["model"]))
        if model is None:
            problems.append(f"{where}.model: {raw['model']!r} is not a model or alias in the catalog "
                            f"(known: {', '.join(sorted(catalog.names())) or 'none'})")
            continue
        profiles = {p.name: p for p in model.profiles}
        pname = raw.get("profile")
        if pname is None:
            profile = model.ranked()[0]
        elif pname in profiles:
            profile = profiles[pname]
        else:
            problems.append(f"{where}.profile: {pname!r} is not a profile of {model.name!r} "
                            f"(it has {', '.join(profiles)})")
            continue
        engine = str(raw.get("engine") or profile.engine)
        spec = catalog.engines.get(engine)
        metrics_path = raw["metrics_path"] if "metrics_path" in raw else (spec.metrics if spec else "/metrics")
        url = str(raw["url"]).rstrip("/")
        rid = str(raw.get("id") or f"{model.name}@{url.split('://', 1)[-1]}")
        if rid in seen:
            problems.append(f"{where}.id: {rid!r} is already used by endpoints[{seen[rid]}]; give each its own id")
            continue
        seen[rid] = i
        try:
            ep = Endpoint(replica_id=rid, model=model.name, profile=profile.name, engine=engine, url=url,
                          priority=int(raw.get("priority", profile.priority)),
                          weight=float(raw.get("weight", profile.weight)), metrics_path=metrics_path)
            parse_target(ep.url)    # a port past 65535, say: the router would leave it out, so refuse it here
            out.append(ep)
        except BadEndpointURL as exc:
            problems.append(f"{where}.url: {exc}")
        except (TypeError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
    if problems:
        raise EndpointFileError("\n".join(problems))
    return out
