"""Engines: how to launch and probe each kind of inference server.

Owns one driver per built-in engine (vLLM, SGLang, llama.cpp's llama-server,
and the built-in fake), the template driver for engines a catalog defines,
and the metrics adapters that turn an engine's /metrics page into a
`LoadReading`. `spec.py` holds what a driver is (`Driver`, `Launch`); what it
is given and hands back to other pieces (`ReplicaSpec`, `LoadReading`) is in
`llmgwctl.contracts`.

Drivers only *describe* processes (argv, env, probe paths) and read pages;
they never start, stop or poll anything, so the agent owns process life and
the router owns polling. Nothing here knows about placement, the reconciler
or the router; the fake engine's server (`fake_server.py`) is imported only by
`llmgwctl engine fake`.

    driver_for("vllm") / driver_for(replica_spec, allowed)  -> Driver
    parse_load("sglang", page_text)                         -> LoadReading | None
    available_engines(allowed=...)                          -> {name: (ok, reason)}

A replica of a catalog-defined engine gets a driver only from the node's
`AllowedEngines` (custom.py): with none given, no catalog engine runs. No
replica gets one whose env loads code or whose args run code the node does
not allow (codeargs.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from ..catalog import EngineSpec
from ..contracts import LoadReading, ReplicaSpec
from .custom import NOTHING_ALLOWED, AllowedEngines, TemplateDriver, allow_hint, parse_any
from .errors import EngineError, EngineNotAllowed, LaunchError, NotAllowed, SpecNotAllowed, UnknownEngine
from .fake import FakeDriver
from .llamacpp import LlamacppDriver
from .sglang import SglangDriver
from .spec import Driver, Launch
from .vllm import VllmDriver

BUILTIN_DRIVERS: Mapping[str, Driver] = MappingProxyType({
    d.name: d for d in (VllmDriver(), SglangDriver(), LlamacppDriver(), FakeDriver())
})

__all__ = [
    "AllowedEngines", "BUILTIN_DRIVERS", "Driver", "EngineError", "EngineNotAllowed", "Launch", "LaunchError",
    "NOTHING_ALLOWED", "NotAllowed", "SpecNotAllowed", "TemplateDriver", "UnknownEngine", "allow_hint", "available_engines", "driver_for", "parse_load",
]


def driver_for(spec_or_engine: ReplicaSpec | str, allowed: AllowedEngines = NOTHING_ALLOWED) -> Driver:
    """The driver for a replica (a catalog engine's template travels in its spec) or a built-in name.

    A catalog engine's replica runs only as `allowed` permits (EngineNotAllowed
    otherwise), and no replica runs with env or args that would load other code
    into its engine unless `allowed` permits the option (SpecNotAllowed),
    whatever its spec says: the spec comes from the controller, the allowance
    from the node's operator.
    """
    if isinstance(spec_or_engine, str):
        try:
            return BUILTIN_DRIVERS[spec_or_engine]
        except KeyError:
            raise UnknownEngine(f"no built-in engine {spec_or_engine!r} (built in: {', '.join(BUILTIN_DRIVERS)}); "
                                "a catalog-defined engine needs its replica spec, which carries its command") from None
    spec = spec_or_engine
    # Before any driver: env that loads code and options that run it are
    # refused for every engine, built-in ones included (SpecNotAllowed).
    allowed.check(spec)
    if spec.engine in BUILTIN_DRIVERS:
        return BUILTIN_DRIVERS[spec.engine]
    if not spec.command:
        raise UnknownEngine(f"replica {spec.id}: engine {spec.engine!r} is not built in and its spec carries no "
                            "command template")
    return allowed.driver(spec)


def parse_load(engine: str, text: str) -> LoadReading | None:
    """The load on an engine's /metrics page; None if the page has none of the engine's families.

    Never raises: a garbled page is no reading, not an error on the router's poll loop.
    An engine without a built-in adapter is tried against each of them (see custom.py).
    """
    driver = BUILTIN_DRIVERS.get(engine)
    if driver is None:
        return parse_any(text)
    return driver.parse_metrics(text)


def available_engines(catalog_engines: Iterable[EngineSpec] = (), *,
                      allowed: AllowedEngines = NOTHING_ALLOWED) -> dict[str, tuple[bool, str]]:
    """Which engines this node can run, each with its reason: the built-ins, the allowed ones, and any catalog ones given.

    A catalog engine's entry says only whether its program is on this node;
    whether the node runs it is `allowed`'s to say.
    """
    found = {name: driver.available() for name, driver in BUILTIN_DRIVERS.items()}
    found.update(allowed.available())
    for engine in catalog_engines:
        if engine.name not in BUILTIN_DRIVERS:
            found[engine.name] = TemplateDriver(engine.name, engine.command, engine.health,
                                                engine.metrics).available()
    return found
