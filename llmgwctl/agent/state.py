"""What the agent remembers across its own restart: `STATE_DIR/replicas.json`.

Owns the record of each engine the agent started (its spec, and the pid, start
time and group that identify the process) and writing it so that a crash at
any moment leaves either the old file or the new one, never half of one; the
instance id of the agent that wrote it (so its successor can prove to the
controller it is the same node restarting); and the lock that keeps a second
agent out of a state directory in use. The directory is private (0700): engine
logs hold prompts and tracebacks. It must not know how processes are started
or probed.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..contracts import ReplicaSpec
from ..fsutil import write_atomically
from .errors import StateLockedError

log = logging.getLogger("llmgw.agent.state")

FORMAT = 1
FILENAME = "replicas.json"
LOCKNAME = "agent.lock"


def private_dir(path: Path) -> None:
    """Create `path` (and parents) so only this user can read it; tighten it if it is looser."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)


def lock(state_dir: Path) -> TextIO:
    """Hold the state directory for this process's life; StateLockedError if another agent does.

    An flock, not a pid file: the kernel drops it when the holder dies, even by
    SIGKILL, so a restarted agent never waits for a stale lock, and engines
    never hold it (our file descriptors are not inherited). Returns the open
    file; the lock lasts while it stays open.
    """
    private_dir(state_dir)
    f = open(state_dir / LOCKNAME, "a+", encoding="utf-8")  # noqa: SIM115 -- the open file is the lock: returned, held
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip()[:40]
        f.close()
        raise StateLockedError(f"{state_dir} is in use by another agent (pid {holder or 'unknown'}); "
                               "one agent per state directory -- stop that one, or give this one its own "
                               "--state-dir and --node") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@dataclass(frozen=True, slots=True)
class Record:
    """One engine process this agent started: enough to find it again and vouch it is ours."""

    spec: ReplicaSpec
    pid: int
    start_time: int       # /proc/PID/stat field 22: with the pid, the process's identity
    pgid: int
    port: int | None      # None: a group's worker, which serves nothing (agent/members.py)
    restarts: int = 0
    health_path: str = "/health"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.spec.id, "spec": self.spec.to_dict(), "spec_hash": self.spec.spec_hash,
                "pid": self.pid, "start_time": self.start_time, "pgid": self.pgid, "port": self.port,
                "restarts": self.restarts, "health_path": self.health_path}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        return cls(spec=ReplicaSpec.from_dict(data["spec"]), pid=int(data["pid"]),
                   start_time=int(data["start_time"]), pgid=int(data["pgid"]),
                   port=None if data.get("port") is None else int(data["port"]),
                   restarts=int(data.get("restarts", 0)), health_path=str(data.get("health_path", "/health")))


def save(state_dir: Path, boot_id: str, records: list[Record], instance_id: str = "") -> None:
    """Write the records atomically: temp file in the same directory, fsync, rename, fsync the dir."""
    private_dir(state_dir)
    doc = {"format": FORMAT, "boot_id": boot_id, "replicas": [r.to_dict() for r in records]}
    if instance_id:
        doc["instance_id"] = instance_id
    write_atomically(state_dir / FILENAME, json.dumps(doc, indent=1, sort_keys=True).encode())


def previous_instance(state_dir: Path) -> str:
    """The instance id of the agent that last wrote the state file; "" if none is recorded."""
    try:
        doc = json.loads((state_dir / FILENAME).read_text())
    except (OSError, ValueError):
        return ""
    value = doc.get("instance_id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else ""


def load(state_dir: Path, boot_id: str) -> list[Record]:
    """The records of the last run; [] when there is none or it is from another boot.

    A file that cannot be read is set aside as replicas.json.bad-N, not
    deleted, so an operator can see what the agent could not use; the agent
    then adopts nothing and kills nothing it cannot vouch for.
    """
    path = state_dir / FILENAME
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, this agent writes {FORMAT}")
        if doc.get("boot_id") != boot_id:
            log.info("%s is from an earlier boot of this machine: none of its engines can still run", path)
            return []
        return [Record.from_dict(r) for r in doc.get("replicas", [])]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        n = 0
        while (bad := path.with_name(f"{FILENAME}.bad-{n}")).exists():
            n += 1
        os.replace(path, bad)
        log.error("%s could not be read (%s); moved to %s and starting with no engines adopted",
                  path, exc, bad)
        return []
