"""Real pieces for the agent's end-to-end tests: a recording stand-in for the
controller, an agent process, and cleanup that leaves no engine behind.

The controller does not exist yet; `RecordingController` speaks its side of
the agent protocol (DESIGN.md "Agent protocol") and remembers everything it
was sent, so tests read the agent's reports the way the controller will.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web


class RecordingController:
    """An aiohttp server on 127.0.0.1 in its own thread: records reports, answers the desired long-poll."""

    def __init__(self, hold: float = 3.0):
        # A short hold (the real controller holds ~30 s) so tests see several polls.
        self.hold = hold
        self.reports: list[dict[str, Any]] = []
        self.report_headers: list[dict[str, str]] = []
        self.polls: list[dict[str, str]] = []
        self.version = 0
        self.replicas: list[dict[str, Any]] = []
        self.fail_status: int | None = None    # answer every request with this status while set
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("recording controller did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._changed = asyncio.Event()
        app = web.Application()
        app.router.add_post("/api/v1/agents/{node}/report", self._report)
        app.router.add_get("/api/v1/agents/{node}/desired", self._desired)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _report(self, request: web.Request) -> web.Response:
        if self.fail_status:
            return web.Response(status=self.fail_status, text="failing on purpose")
        body = await request.json()
        with self._lock:
            self.reports.append({**body, "_node_in_path": request.match_info["node"], "_at": time.monotonic()})
            self.report_headers.append(dict(request.headers))
        return web.json_response({"ok": True})

    async def _desired(self, request: web.Request) -> web.Response:
        with self._lock:
            self.polls.append(dict(request.query))
        if self.fail_status:
            return web.Response(status=self.fail_status, text="failing on purpose")
        after = int(request.query.get("after", "0"))
        if after == self.version:
            try:
                await asyncio.wait_for(self._changed.wait(), self.hold)
            except asyncio.TimeoutError:
                pass
        return web.json_response({"version": self.version, "replicas": self.replicas})

    def set_desired(self, replicas: list[dict[str, Any]]) -> None:
        def bump() -> None:
            self.version += 1
            self.replicas = replicas
            self._changed.set()
            self._changed.clear()   # waiters already woken; the next poll waits again
        self._loop.call_soon_threadsafe(bump)

    def latest(self) -> dict[str, Any] | None:
        with self._lock:
            return self.reports[-1] if self.reports else None

    def report_count(self) -> int:
        with self._lock:
            return len(self.reports)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def replicas_by_id(report: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in (report or {}).get("replicas", [])}


class AgentProcess:
    """`python -m llmgwctl agent ...` in its own session, output to a log file."""

    def __init__(self, args: list[str], log_path: Path):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "llmgwctl", "agent", "-v", *args],
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
