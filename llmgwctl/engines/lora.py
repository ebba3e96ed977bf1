"""LoRA on the engines: the flags that start a base with adapters enabled, and where an adapter's source is.

vLLM serves adapters beside its base when started with `--enable-lora`
(slots and largest rank from the catalog's `lora:`, contracts.ReplicaSpec),
and loads and unloads them at run time through `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter`, which it opens only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment. Those routes are
for llmgw's agent (llmgwctl.agent.adapters): the router's route table does
not carry them, so no client reaches them. The fake engine takes the same
flags and speaks the same routes.

llama.cpp loads adapters only at launch (engines/llamacpp.py), numbered in
the order of its --lora flags, and lists them with their numbers at
`GET /lora-adapters`: `numbered()` reads that list into which number is
which adapter, what a request to it names (the router writes the number).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..contracts import ReplicaSpec
from .base import samples
from .errors import LaunchError
from .pkgsource import resolve_in_package

_INFO = "vllm:lora_requests_info"

# Engines whose adapters the agent loads with vLLM's routes.
RUNTIME_API = frozenset({"vllm", "fake"})
# Engines that load adapters only at launch, and the route listing them with their numbers.
LAUNCH_LISTING = {"llamacpp": "/lora-adapters"}
# vLLM refuses the runtime routes without it (they let a caller load code-free
# weights from any path the engine can read; only the agent reaches them).
RUNTIME_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_args(spec: ReplicaSpec) -> tuple[str, ...]:
    """vLLM's flags for a base that serves adapters; () for one that does not."""
    if not spec.lora_slots:
        return ()
    # --max-cpu-loras: adapters held in host memory, ready to swap onto the
    # GPU's slots. vLLM defaults it to max_loras, which makes every adapter
    # past the slots a reload from disk; 4 times the slots keeps a replica's
    # placed adapters in memory for the common case of a few dozen per base.
    return ("--enable-lora", "--max-loras", str(spec.lora_slots), "--max-lora-rank", str(spec.lora_rank),
            "--max-cpu-loras", str(spec.lora_slots * 4))


def resolve_source(source: str) -> str:
    """What the engine is told to load for an adapter's `source`: a directory's absolute path, or a hub id as is.

    `pkg:PACKAGE/DIR` is a directory inside an installed Python package
    (found without importing it); a source starting with `/`, `.` or `~` is a
    path on this node and must be a directory. LaunchError says what was
    looked for. Anything else is a hub id, which vLLM downloads itself.
    """
    if source.startswith("pkg:"):
        return str(resolve_in_package(source, "adapter source", "pkg:PACKAGE/DIR", "directory"))
    if source.startswith(("/", ".", "~")):
        path = Path(os.path.expanduser(source)).absolute()
        if not path.is_dir():
            raise LaunchError(f"adapter source {source!r}: no such directory on this node ({path})")
        return str(path)
    return source


def busy_adapters(page: str) -> frozenset[str] | None:
    """The adapters an engine's /metrics says requests are running or waiting on; None if the page does not say.

    vLLM's `lora_requests_info` is an info gauge whose value is the time it
    was set: each change leaves a series with new labels beside the old ones,
    so the newest (the highest value) is the one in force.
    """
    found = samples(page, (_INFO,))
    info = found.get(_INFO) if found else None
    if not info:
        return None
    labels = max(info, key=lambda sample: sample[1])[0]
    names = labels.get("running_lora_adapters", "").split(",") + labels.get("waiting_lora_adapters", "").split(",")
    return frozenset(n for n in names if n)


def numbered(listing: Any, paths: Sequence[tuple[str, str]]) -> dict[str, int]:
    """Adapter name -> the engine's number for it, from llama-server's `GET /lora-adapters` list.

    `paths` are (name, the file it was launched with) in launch order. An
    entry is matched by its path, the first adapter of that path not yet
    matched taking it (two names for one file get one number each, in
    order); an entry that is not an object with an integer id and a string
    path matches nothing, as does an adapter whose file the engine does not list.
    """
    if not isinstance(listing, list):
        raise ValueError(f"expected a list of adapters, got {type(listing).__name__}")
    free: dict[str, list[str]] = {}
    for name, path in paths:
        free.setdefault(path, []).append(name)
    out: dict[str, int] = {}
    for entry in listing:
        if not isinstance(entry, dict):
            continue
        number, listed = entry.get("id"), entry.get("path")
        if type(number) is int and number >= 0 and isinstance(listed, str) and free.get(listed):
            out[free[listed].pop(0)] = number
    return out
