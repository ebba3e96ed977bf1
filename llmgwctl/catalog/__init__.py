"""The catalog: which models llmgw serves, and how each may run.

Owns the immutable `Catalog` (models, aliases, profiles, engines), loading and
validating a directory of YAML files (`load_dir`, `load_paths`) or a document
already parsed (`load_document`), `Live` (the one
current catalog), `diff` between two catalogs, and the `CatalogWatcher` that
follows a directory and swaps `Live` only to valid catalogs.

It must not know about anything else in llmgw: nothing here imports another
llmgwctl subpackage, so every other piece can depend on it.
"""
from typing import TYPE_CHECKING

from .durations import format_duration, parse_duration
from .errors import CatalogError, Problem, format_path
from .live import Live
from .model import (
    API_VERSION,
    AUTOSCALE_METRICS,
    BUILTIN_ENGINES,
    KIND,
    LORA_ENGINES,
    Adapter,
    AdapterRef,
    Autoscale,
    Catalog,
    EngineSpec,
    Lora,
    Model,
    Origin,
    Profile,
    Replicas,
    ScalingPolicy,
)

__all__ = [
    "API_VERSION", "AUTOSCALE_METRICS", "Adapter", "AdapterRef", "Autoscale", "LORA_ENGINES", "Lora", "BUILTIN_ENGINES", "KIND", "Catalog", "CatalogError", "EngineSpec", "Live", "Model",
    "Origin", "Problem", "Profile", "Replicas", "ScalingPolicy", "format_duration", "format_path", "parse_duration",
    "load_dir", "load_document", "load_paths", "load_text",
]


if TYPE_CHECKING:   # the real names, for the checker; at run time __getattr__ loads them
    from .loader import load_dir, load_paths, load_text


def __getattr__(name: str) -> object:

    # The loader pulls in yaml and jsonschema; import it only when it is used,
    # so code that only reads catalogs (the router's hot path) stays light.
    if name in ("load_dir", "load_document", "load_paths", "load_text"):
        from . import loader
        return getattr(loader, name)
    raise AttributeError(name)
