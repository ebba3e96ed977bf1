"""Real pieces for the agent's end-to-end tests: an agent process, and cleanup
that leaves no engine behind. The controller they talk to is the real one
(`tests.controlplane`), recording what the agent sent it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def replicas_by_id(report: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in (report or {}).get("replicas", [])}


class AgentProcess:
    """`python -m llmgwctl agent ...` in its own session, output to a log file."""

    def __init__(self, args: list[str], log_path: Path):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "llmgwctl", "agent", "--log-level", "debug", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sigkill(self) -> None:
        """kill -9 the agent alone (not its group, and engines are in their own sessions anyway)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def kill_engines_under(state_dir: Path) -> None:
    """Kill every process group whose leader runs in `state_dir` (the agent starts engines there)."""
    target = str(state_dir.resolve())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/cwd") != target:
                continue
            os.killpg(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def group_alive(pgid: int) -> list[int]:
    """Non-zombie processes in group `pgid`, read straight from /proc (not via the agent's code)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def write_desired(path: Path, replicas: list[dict[str, Any]]) -> None:
    """Write atomically, as an operator's tooling would, so the agent never reads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"replicas": replicas}))
    os.replace(tmp, path)
