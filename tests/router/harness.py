"""Real pieces for router tests: fake-engine processes and a router serving on loopback in a thread.

Engines run as `python -m llmgwctl engine fake` in their own process groups and
are killed by the fixture even when a test fails. The router runs in a thread
with its own event loop so tests can drive it with synchronous clients (the
official `openai` package, `requests`) and still push endpoints and catalogs
to it through its real interface, on its loop.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from llmgwctl.catalog import Catalog, Model, Profile
from llmgwctl.contracts import Endpoint, LoadReading
from llmgwctl.engines import parse_load
from llmgwctl.router import Router, RouterConfig, start

from ..procs import kill_group
from ..support import LoopThread, wait_until

# Starting a Python process and binding takes well under a second here; ten
# covers a loaded 2-core machine.
START_DEADLINE = 10.0


@dataclass
class Engine:
    proc: subprocess.Popen
    url: str
    model: str
    replica_id: str

    def load(self) -> LoadReading | None:
        return parse_load("fake", requests.get(self.url + "/metrics", timeout=5).text)

    def endpoint(self, *, profile: str = "default", priority: int = 0, weight: float = 1.0,
                 model: str | None = None) -> Endpoint:
        return Endpoint(replica_id=self.replica_id, model=model or self.model, profile=profile, engine="fake",
                        url=self.url, priority=priority, weight=weight)

    def kill(self) -> None:
        kill_group(self.proc)


def spawn_engine(model: str, replica_id: str, *args: str, stderr=None) -> Engine:
    """A fake engine process; `stderr`: a path its stderr goes to (with --log-requests, a line per request)."""
    err = open(stderr, "ab") if stderr is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgwctl", "engine", "fake", "--port", "0", "--model", model,
             "--replica-id", replica_id, *args],
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    finally:
        if stderr is not None:
            err.close()
    engine = Engine(proc, "", model, replica_id)
    try:
        line = _readline(proc, START_DEADLINE)
        # "fake engine serving NAME on http://127.0.0.1:PORT"
        engine.url = line.rsplit(" ", 1)[-1].strip()
        wait_until(lambda: _healthy(engine.url), timeout=START_DEADLINE, what=f"{engine.url}/health")
    except BaseException:
        engine.kill()
        raise
    return engine


def static_router_args(root: Path, model: str, url: str, replica_id: str) -> list[str]:
    """Write a one-model catalog directory and a static endpoint file (one fake engine at `url`) under `root`.

    Returns the `llmgwctl router` arguments that serve them.
    """
    (root / "cat").mkdir()
    (root / "cat" / "m.yaml").write_text(
        f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: {model}\n    source: org/m\n"
        "    profiles: [{name: default, engine: fake, gpus: 0}]\n")
    (root / "eps.yaml").write_text(f"endpoints:\n  - {{model: {model}, url: '{url}', id: {replica_id}}}\n")
    return ["--endpoints", str(root / "eps.yaml"), "--catalogs", str(root / "cat")]


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box or not box[0]:
        raise AssertionError(f"fake engine did not announce its port within {timeout} s (exit {proc.poll()})")
    return box[0]


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def catalog(*models: tuple[str, tuple[str, ...]] | Model) -> Catalog:
    """A catalog of fake-engine models: ("name", ("alias", ...)) pairs or ready-made Models."""
    built = []
    for m in models:
        if isinstance(m, Model):
            built.append(m)
        else:
            name, aliases = m
            built.append(Model(name=name, aliases=aliases, source=f"org/{name}", profiles=(Profile(name="default", engine="fake", gpus=0),)))
    return Catalog(built)


class RouterThread(LoopThread):
    """A real router on 127.0.0.1:<free port>, its loop in a daemon thread; `call` runs on that loop."""

    def __init__(self, router: Router):
        super().__init__()
        self.router = router
        self._runner, port = self.call_async(start(router, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{port}"

    def set_endpoints(self, endpoints) -> None:
        self.call(self.router.set_endpoints, list(endpoints))

    def set_catalog(self, cat: Catalog) -> None:
        self.call(self.router.set_catalog, cat)

    def shutdown(self) -> None:
        self.call_async(self._runner.cleanup())


def make_router(cat: Catalog, *, waker=None, **config: Any) -> Router:
    return Router(cat, waker=waker, config=RouterConfig(**config))
