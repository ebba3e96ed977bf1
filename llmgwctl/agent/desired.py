"""Which replicas this node should run: parsing a desired list, and following a file of one.

Owns the desired-list document `{replicas: [ReplicaSpec dicts]}` -- what the
controller's long-poll answers with and what `--desired FILE` holds -- and the
file follower used when there is no controller. It must not know how replicas
are started, nor how the controller chooses them.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..contracts import ReplicaSpec
from ..fsutil import UnusableFile, read_regular
from .errors import DesiredError

log = logging.getLogger("llmgw.agent.desired")

REQUIRED = ("id", "model", "engine")
# The most a desired file may hold: 1,000 replicas a node (the catalog's bound)
# of up to 16 KB of spec each. Read as every followed file is
# (`fsutil.read_regular`): a FIFO, a device or a bigger file is refused, never
# waited on or read without end.
MAX_BYTES = 16 << 20


def parse_replicas(items: Any, where: str) -> tuple[ReplicaSpec, ...]:
    """A list of ReplicaSpec dicts -> specs; DesiredError naming every bad entry."""
    if not isinstance(items, list):
        raise DesiredError(f"{where}: 'replicas' must be a list, got {type(items).__name__}")
    problems, specs, seen = [], [], set()
    for i, item in enumerate(items):
        at = f"{where}: replicas[{i}]"
        if not isinstance(item, Mapping):
            problems.append(f"{at}: must be a mapping with at least {', '.join(REQUIRED)}")
            continue
        missing = [k for k in REQUIRED if not item.get(k)]
        if missing:
            problems.append(f"{at}: missing {', '.join(missing)}")
            continue
        try:
            spec = ReplicaSpec.from_dict(item)
        except (TypeError, ValueError, AttributeError) as exc:
            problems.append(f"{at}: {exc}")
            continue
        if spec.gpu_indices and len(spec.gpu_indices) != spec.gpus and "gpus" in item:
            problems.append(f"{at}: gpus is {spec.gpus} but gpu_indices lists {len(spec.gpu_indices)}")
            continue
        if spec.gpu_indices and "gpus" not in item:
            spec = ReplicaSpec.from_dict({**item, "gpus": len(spec.gpu_indices)})
        if spec.id in seen:
            problems.append(f"{at}: id {spec.id!r} is used twice; ids name one replica each")
            continue
        seen.add(spec.id)
        specs.append(spec)
    if problems:
        raise DesiredError("\n".join(problems))
    return tuple(specs)


def parse_document(text: str, where: str) -> tuple[ReplicaSpec, ...]:
    """A desired file's text (YAML, so JSON too) -> specs."""
    try:
        doc = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise DesiredError(f"{where}: not valid YAML or JSON: {exc}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise DesiredError(f"{where}: expected a mapping with a 'replicas' list")
    return parse_replicas(doc.get("replicas", []), where)


class DesiredFile:
    """Follows `--desired FILE`: re-read when its mtime, size or inode changes.

    `poll()` is the one pass; the agent calls it whenever the file's directory
    says the file changed (`llmgwctl.aio.follow_file`), and the stamp check
    makes a call for nothing cost one stat. An invalid file is logged and the
    last good list kept.
    """

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self.last_error: str | None = None

    def poll(self) -> tuple[ReplicaSpec, ...] | None:
        """New specs if the file changed and is valid; None otherwise. Blocking: run in a thread."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._seen:
                return None
            self._seen = stamp
            text = read_regular(self.path, MAX_BYTES, "desired file").decode("utf-8", "replace")
            specs = parse_document(text, str(self.path))
        except UnusableFile as exc:
            self._fail(str(exc))
            return None
        except OSError as exc:
            self._fail(f"{self.path}: cannot read: {exc.strerror or exc}")
            return None
        except DesiredError as exc:
            self._fail(str(exc))
            return None
        self.last_error = None
        log.info("%s: %d desired replica(s)", self.path, len(specs))
        return specs

    def _fail(self, message: str) -> None:
        """Log a new failure once; the caller keeps the last good list."""
        if message != self.last_error:
            log.error("%s -- keeping the last good desired list", message)
        self.last_error = message


