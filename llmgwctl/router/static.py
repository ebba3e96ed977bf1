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
        adapters: [qwen-sql]         # optional: the model's LoRA adapters this engine serves (names or aliases);
                                     # for llama.cpp, in the order of its --lora flags, which numbers them

Defaults come from the catalog so the file only says where engines listen; the
catalog stays the one place that says how models rank. Every problem in the
file is reported at once, each as `FILE: endpoints[i].field: what is wrong`.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from ..catalog import Catalog, Live, Model
from ..contracts import Endpoint, RouterSink
from ..fsutil import FollowedFile
from .errors import RouterError
from .loraselect import SELECTS_BY_BODY
from .upstream import BadEndpointURL, parse_target
from .yamlfile import MAX_BYTES, Layout, entries, parse_yaml

log = logging.getLogger("llmgw.router")

_LAYOUT = Layout(key="endpoints", fields=frozenset({"model", "url", "profile", "id", "priority", "weight", "engine",
                                                    "metrics_path", "adapters"}),
                 required=("model", "url"), example="endpoints: [{model: qwen, url: 'http://127.0.0.1:8000'}]",
                 entry="expected a mapping with at least model and url", some_of=True, blank_is_missing=True)


class EndpointFileError(RouterError):
    """The endpoint file cannot be used; the message lists every problem, one per line."""


class EndpointFileFollower(FollowedFile[list[Endpoint]]):
    """Follows the endpoint file (`fsutil.FollowedFile`): every usable state is the sink's endpoint list.

    Parsed against the catalog of the moment, `catalog()` (its defaults come
    from there), so a catalog swap asks for a read too (`check()`). A file that
    cannot be used -- invalid, a FIFO, a device, past its cap, deleted,
    unreadable -- leaves the endpoints in force as they were: the engines
    behind them are still there, and emptying the list would answer every
    request 503 for a file caught half way through a deploy.
    """

    def __init__(self, path: str | os.PathLike[str], sink: RouterSink, catalog: Callable[[], Catalog]):
        source = os.path.abspath(os.fspath(path))

        def applied(endpoints: list[Endpoint]) -> None:
            # The whole list: a file says nothing of what changed since the last read.
            sink.set_endpoints(endpoints)
            log.info("endpoints in force from %s: %d", source, len(endpoints), extra={"event": "endpoints-reloaded"})

        super().__init__(source, name="endpoints", what="endpoint file", rejects=EndpointFileError,
                         max_bytes=MAX_BYTES, apply=applied, keeping="keeping the endpoints in force",
                         parse=lambda data: parse_endpoints(parse_yaml(data, source, EndpointFileError),
                                                            catalog(), source))


def follow_endpoints(sink: RouterSink, path: str | os.PathLike[str], stop: asyncio.Event,
                     catalog: Callable[[], Catalog]) -> EndpointFileFollower:
    """Tell `sink` the endpoints in `path` now, and follow the file until `stop` (the task: `.task`).

    EndpointFileError if the file is unusable at start. Call on the loop, with
    `catalog()` the catalog the sink has been told.
    """
    follower = EndpointFileFollower(path, sink, catalog)
    follower.load_initial()
    follower.start(stop)
    return follower


class StaticSource:
    """A router's source with no control plane: a catalog directory and an endpoint file, told to a `RouterSink`.

    The directory is followed by the catalog watcher (a valid edit swaps in,
    an invalid one is logged and ignored), the file by `EndpointFileFollower`,
    read again after every catalog swap (its defaults come from the catalog)
    and on `reread()` (SIGHUP). The sink is told a new catalog before the
    endpoints read against it. Never model states: nothing here knows of a
    replica starting or a model that cannot be placed.
    """

    def __init__(self, endpoints_file: str | os.PathLike[str], catalogs_dir: str | os.PathLike[str]):
        from ..catalog.watcher import CatalogWatcher  # the loader is heavy; only this mode needs it

        self.live = Live()
        self.catalogs = CatalogWatcher(os.fspath(catalogs_dir), self.live)
        self._endpoints_file = endpoints_file
        self._tasks: list[asyncio.Task[Any]] = []

    def load_initial(self) -> Catalog:
        """The catalog in the directory now; CatalogError if there is none to serve. Blocking."""
        return self.catalogs.load_initial()

    def start(self, sink: RouterSink, stop: asyncio.Event, tasks: list[asyncio.Task[Any]]) -> EndpointFileFollower:
        """Tell `sink` the catalog and the endpoints now, and follow both until `stop`, the tasks doing so in `tasks`
        (a reread's only while it runs). EndpointFileError if the file is unusable now. On the loop, after `load_initial`."""
        self._tasks = tasks
        sink.set_catalog(self.live.current)
        self.endpoints = follow_endpoints(sink, self._endpoints_file, stop, lambda: self.live.current)

        def swapped(old: Catalog, new: Catalog) -> None:
            sink.set_catalog(new)       # first: the file's endpoints are read against it next
            self.reread()

        self.live.subscribe(swapped)
        tasks.append(asyncio.get_running_loop().create_task(self.catalogs.run(stop)))
        tasks.append(self.endpoints.task)
        return self.endpoints

    def reread(self) -> None:
        """Read the endpoint file again, against the catalog of the moment. On the loop."""
        tasks = self._tasks
        task = asyncio.get_running_loop().create_task(self.endpoints.check(), name="endpoints-reread")
        tasks.append(task)          # cancelled with the rest at exit; forgotten once done
        task.add_done_callback(lambda t: tasks.remove(t) if t in tasks else None)


def parse_endpoints(doc: Any, catalog: Catalog, source: str = "<endpoints>") -> list[Endpoint]:
    problems: list[str] = []
    out: list[Endpoint] = []
    seen: dict[str, int] = {}
    for i, where, raw in entries(doc, _LAYOUT, source, EndpointFileError, problems):
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
        metrics_path = raw.get("metrics_path", spec.metrics if spec else "/metrics")
        url = str(raw["url"]).rstrip("/")
        rid = str(raw.get("id") or f"{model.name}@{url.split('://', 1)[-1]}")
        if rid in seen:
            problems.append(f"{where}.id: {rid!r} is already used by endpoints[{seen[rid]}]; give each its own id")
            continue
        seen[rid] = i
        listed = _adapters(raw.get("adapters"), model, f"{where}.adapters", problems)
        if listed is None:
            continue
        # llama.cpp numbers its adapters in the order of its --lora flags, which the list follows.
        ids: dict[str, int] = {}
        for i, name in enumerate(listed if engine in SELECTS_BY_BODY else ()):
            ids.setdefault(name, i)
        try:
            ep = Endpoint(replica_id=rid, model=model.name, profile=profile.name, engine=engine, url=url,
                          priority=int(raw.get("priority", profile.priority)),
                          weight=float(raw.get("weight", profile.weight)), metrics_path=metrics_path,
                          adapters=frozenset(listed), adapter_ids=MappingProxyType(ids))
            parse_target(ep.url)    # a port past 65535, say: the router would leave it out, so refuse it here
            out.append(ep)
        except BadEndpointURL as exc:
            problems.append(f"{where}.url: {exc}")
        except (TypeError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
    if problems:
        raise EndpointFileError("\n".join(problems))
    return out


def _adapters(raw: Any, model: Model, where: str, problems: list[str]) -> list[str] | None:
    """The adapters an endpoint serves, by their canonical names, in order; None (with the problem said) if one is not
    the model's. Nothing loads them: with no controller, the engine was started with them by its operator."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        problems.append(f"{where}: expected a list of adapter names, e.g. [{model.name}-sql]")
        return None
    names = {n: a.name for a in model.adapters for n in (a.name, *a.aliases)}
    unknown = [a for a in raw if a not in names]
    if unknown:
        known = ", ".join(a.name for a in model.adapters) or "none"
        problems.append(f"{where}: {', '.join(repr(a[:100]) for a in unknown[:5])} "
                        f"{'is not an adapter' if len(unknown) == 1 else 'are not adapters'} of "
                        f"{model.name!r} in the catalog (it has: {known})")
        return None
    return [names[a] for a in raw]
