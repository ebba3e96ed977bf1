"""The operator's holds on nodes (cordoned, draining), kept in a file so they outlive a controller restart.

The controller keeps no database: what runs is reported by agents, what is
wanted is in git. A cordon is neither. It is the operator's word about a
machine -- "this one is going down for a driver update" -- and must hold
while the controller restarts: a controller that forgot it would place
replicas back on a node under maintenance, or stop a drain half way. kubectl
keeps it on the Node object, in the API server's store, not on the node; so
does this, in the controller's state directory (`serve --state-dir`), and not
with the agent, whose machine may be the one being reinstalled.

    {"apiVersion": "llmgw/v1", "kind": "NodeHolds", "nodes": {"gpu-7": {"drain": true}, "gpu-9": {"drain": false}}}

Written atomically (temp file, fsync, rename) before a change takes effect;
read once at start. A file that cannot be read stops the start (HoldsFileError),
as an invalid catalog does: starting without the holds would undo them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..fsutil import MissingFile, UnusableFile, read_regular, write_atomically
from .errors import ControlError

FILENAME = "node-holds.json"
# A hold is a line of JSON per node: 1 MiB is tens of thousands of nodes, and
# bounds what a file replaced by something huge makes the controller read.
MAX_HOLDS_BYTES = 1024 * 1024


class HoldsFileError(ControlError):
    """The holds file cannot be read as holds; the message names the file and why."""


def path_in(state_dir: str | os.PathLike[str]) -> Path:
    """Where the controller of `serve --state-dir DIR` keeps its holds: beside the local agent's state, not in it."""
    return Path(state_dir) / "controller" / FILENAME


def load(path: Path) -> dict[str, bool]:
    """node -> drain, as last saved; {} when there is no file yet. HoldsFileError when it cannot be used."""
    try:
        raw = read_regular(path, MAX_HOLDS_BYTES, "node holds file")
    except MissingFile:
        return {}
    except UnusableFile as exc:
        raise HoldsFileError(str(exc)) from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HoldsFileError(f"{path}: not JSON; fix or remove it (removing it uncordons every node)") from None
    nodes = doc.get("nodes") if isinstance(doc, dict) and doc.get("kind") == "NodeHolds" else None
    if not isinstance(nodes, dict) or not all(
            isinstance(name, str) and isinstance(hold, dict) and isinstance(hold.get("drain"), bool)
            for name, hold in nodes.items()):
        raise HoldsFileError(f"{path}: not a NodeHolds document ({{\"kind\": \"NodeHolds\", \"nodes\": "
                             "{NODE: {\"drain\": bool}}}); fix or remove it (removing it uncordons every node)")
    return {name: hold["drain"] for name, hold in nodes.items()}


def save(path: Path, holds: dict[str, bool]) -> None:
    """Write `holds` (node -> drain) atomically; OSError when the disk refuses."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    doc = {"apiVersion": "llmgw/v1", "kind": "NodeHolds",
           "nodes": {name: {"drain": drain} for name, drain in sorted(holds.items())}}
    write_atomically(path, json.dumps(doc, indent=1).encode() + b"\n")
