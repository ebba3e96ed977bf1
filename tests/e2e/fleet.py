"""A small fleet of real processes on 127.0.0.1 for end-to-end tests: a controller, agents, fake engines.

Every process is started in its own session and carries a marker in its
environment; engines inherit it from their agent, so teardown finds and kills
everything a test started -- engines included, which by design outlive their
agents and controllers.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from .. import support
from ..procs import free_port

DEADLINE = 60.0   # seconds for any one condition; generous for a loaded 2-core CI machine


def alive(pid: int) -> bool:
    """The process runs (a zombie waiting for its parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The state follows the command name's closing parenthesis; the name may hold ")" itself.
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], object], what: str, timeout: float = DEADLINE, every: float = 0.1) -> Any:
    """The suite's wait, taking a fleet's usual "not yet" (a server still starting, a field not there yet)."""
    return support.wait_until(predicate, what, timeout, every, errors=(requests.RequestException, KeyError, ValueError))


def write_secret(path: Path, text: str) -> Path:
    """A token file as llmgwctl accepts one: the text on one line, readable by its owner only."""
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return path


def fake_catalog(model: str, replicas: int, *args: str) -> str:
    """A catalog of one model of `replicas` fake-engine replicas on CPU, each run with `args`."""
    flags = ", ".join(f"'{a}'" for a in args)
    return (f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: {model}\n    replicas: {replicas}\n"
            f"    profiles: [{{name: cpu, engine: fake, gpus: 0, args: [{flags}]}}]\n")


class Fleet:
    def __init__(self, root: Path, command: Sequence[str] = (sys.executable, "-m", "llmgwctl"),
                 environ: Mapping[str, str] | None = None):
        """`command` runs llmgwctl (an installed copy's script, say), in `environ` (default: ours)."""
        self.root = root
        self.command = tuple(command)
        self.environ = dict(os.environ if environ is None else environ)
        self.mark = uuid.uuid4().hex
        self._sessions: set[int] = set()
        self.catalogs = root / "catalogs"
        self.catalogs.mkdir(parents=True, exist_ok=True)
        self.router_port = free_port()
        self.control_port = free_port()
        self.controller: subprocess.Popen[bytes] | None = None
        # The admin token status() sends, for a controller started with --token-file.
        self.admin_token: str | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.routers: list[subprocess.Popen[bytes]] = []
        self._agent_args: dict[str, list[str]] = {}
        self._port_base = random.randrange(22000, 29000, 100)
        self._logs: list[IO[bytes]] = []

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def control(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")
        self._logs.append(log)
        env = dict(self.environ, LLMGW_TEST_MARK=self.mark, PYTHONUNBUFFERED="1")
        return subprocess.Popen([*self.command, *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=self.root)

    def start_controller(self, *extra: str, keep_ports: bool = False) -> None:
        # A state directory of the fleet's own (unless the test names one): the controller keeps
        # its node holds (cordon, drain) there, and the default one is shared by every serve on
        # the machine, where one test's drained n1 would stay drained for the next.
        state = () if "--state-dir" in extra else ("--state-dir", str(self.root / "state-controller"))
        for _attempt in range(3):
            self.controller = controller = self._spawn("controller", [
                "serve", "--no-local-agent", "--catalogs", str(self.catalogs),
                "--listen", f"127.0.0.1:{self.router_port}", "--control", f"127.0.0.1:{self.control_port}",
                "--settle", "2", "--drain-grace", "10", "--node-timeout", "2", "--replace-after", "2", *state, *extra])

            def up(proc: subprocess.Popen[bytes] = controller) -> bool:
                return proc.poll() is not None or requests.get(self.control + "/healthz", timeout=1).ok
            wait_until(up, "the control API")
            if controller.poll() is None:
                return
            # Exited: most likely a port another test's process took between our
            # pick and its bind. New ports, unless agents already know these.
            if keep_ports or self.agents:
                time.sleep(1)
            else:
                self.router_port, self.control_port = free_port(), free_port()
        raise AssertionError("controller did not start:\n" + self.log("controller")[-3000:])

    def start_serve(self, *extra: str) -> None:
        """`llmgwctl serve` as a user runs it, local agent included, on this fleet's free ports."""
        self.controller = self._spawn("serve", [
            "serve", "--catalogs", str(self.catalogs), "--listen", f"127.0.0.1:{self.router_port}",
            "--control", f"127.0.0.1:{self.control_port}", "--state-dir", str(self.root / "state-serve"),
            # The top ten of the fleet's hundred ports: start_agent hands out the bottom ones.
            "--ports", f"{self._port_base + 90}-{self._port_base + 99}", "--gpus", "none", *extra])
        wait_until(lambda: requests.get(self.control + "/healthz", timeout=1).ok, "the control API")

    def start_agent(self, node: str, gpus: str, *pools: str) -> None:
        base = self._port_base + 10 * len(self.agents)
        args = ["agent", "--controller", self.control, "--node", node, "--gpus", gpus,
                "--state-dir", str(self.root / f"state-{node}"), "--ports", f"{base}-{base + 9}",
                "--heartbeat", "0.5", "--grace", "3"]
        for pool in pools:
            args += ["--pool", pool]
        self._agent_args[node] = args
        self.agents[node] = self._spawn(f"agent-{node}", args)

    def kill_agent(self, node: str, sig: int = signal.SIGKILL) -> None:
        """Signal the agent process only: its engines run in their own process groups and stay up."""
        proc = self.agents[node]
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=30)

    def restart_agent(self, node: str) -> None:
        """Start `node`'s agent again with the very arguments (state dir, ports) it had."""
        self.agents[node] = self._spawn(f"agent-{node}", self._agent_args[node])

    def start_router(self, *extra: str) -> str:
        """A standalone `llmgwctl router --controller`; returns its base URL once it listens."""
        name = f"router-{len(self.routers)}"
        self.routers.append(self._spawn(name, ["router", "--controller", self.control, "--listen", "127.0.0.1:0",
                                               "--log-level", "warning", *extra]))
        # The router prints its bound port on stdout once its first watch answer is applied.
        found = wait_until(lambda: re.search(r"router listening on (http://127\.0\.0\.1:\d+)", self.log(name)),
                           "the standalone router to listen")
        return str(found.group(1))

    def status(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        resp = requests.get(self.control + "/api/v1/status", headers=headers, timeout=10)
        if resp.status_code != 200:     # a RequestException: what wait_until takes as "not yet"
            raise requests.HTTPError(f"status answered {resp.status_code}: {resp.text}", response=resp)
        status: dict[str, Any] = resp.json()
        return status

    def replicas(self, model: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.status()["replicas"]
                if (model is None or r["model"] == model) and (state is None or r["state"] == state)]

    def ready(self, model: str) -> list[dict[str, Any]]:
        return self.replicas(model, "ready")

    def chat(self, model: str, content: str = "hello", timeout: float = 30, **extra: Any) -> requests.Response:
        return requests.post(self.router + "/v1/chat/completions", timeout=timeout,
                             json={"model": model, "messages": [{"role": "user", "content": content}], **extra})

    def kill_controller(self, sig: int = signal.SIGKILL) -> None:
        if self.controller and self.controller.poll() is None:
            os.killpg(self.controller.pid, sig)
            self.controller.wait(timeout=30)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def marked_pids(self) -> list[int]:
        """Every live process of this fleet: those carrying its marker, engines included, and theirs.

        A marked process's children count too, and so does every process in a
        marked process's session: vLLM's EngineCore and workers rename
        themselves with setproctitle, which overwrites the environment block
        /proc/PID/environ shows, so their marker is gone. Sessions seen once
        are remembered, so a worker whose API server died first is still found.
        """
        needle = f"LLMGW_TEST_MARK={self.mark}".encode()
        ours = os.getsid(0)
        table: dict[int, tuple[int, int]] = {}     # pid -> (parent, session)
        marked: set[int] = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or not alive(int(entry)):
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                table[pid] = (int(fields[1]), int(fields[3]))
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        marked.add(pid)
            except (OSError, IndexError, ValueError):
                continue
        self._sessions.update(table[pid][1] for pid in marked if pid in table and table[pid][1] != ours)
        found = set(marked) | {pid for pid, (_, sid) in table.items() if sid in self._sessions}
        while True:
            children = {pid for pid, (parent, _) in table.items() if parent in found} - found
            if not children:
                return sorted(found)
            found |= children

    def close(self) -> None:
        # Whatever launches engines goes first (agents, and serve's local agent):
        # one still running could start an engine -- restarting one it saw die --
        # between the sweep's listing of marked processes and its kill.
        for proc in [*self.agents.values(), self.controller]:
            if proc is not None and proc.poll() is None:
                proc.kill()     # SIGKILL ends a SIGSTOPped process too
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for pid in self.marked_pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for proc in [self.controller, *self.agents.values(), *self.routers]:
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        # Engines are not our children: give the kernel a moment to finish them
        # (bounded), so a caller checking marked_pids() sees them gone.
        end = time.monotonic() + 10
        while self.marked_pids() and time.monotonic() < end:
            time.sleep(0.05)
        for log in self._logs:
            log.close()

    def close_checked(self) -> None:
        """close(), then fail the test if any process of this fleet outlived it."""
        self.close()
        assert self.marked_pids() == [], "processes left behind"

    def close_waiting(self, what: str = "every process of the fleet to exit", timeout: float = 20) -> None:
        """close(), then wait (bounded) for every process to be gone, closing again while any is left.

        Agents are stopped first, so none can launch an engine while close()
        sweeps the marked processes; SIGKILLed engines take a moment to be gone
        from /proc, hence the wait.
        """
        for node in list(self.agents):
            self.kill_agent(node)
        self.close()
        def swept() -> bool:
            if self.marked_pids() == []:
                return True
            self.close()
            return False
        wait_until(swept, what, timeout)


def hold_streams(router: str, stop: threading.Event, model: str,
                 seen: set[str] | None = None, streams: int = 6) -> list[threading.Thread]:
    """`streams` clients that each keep one slow stream of `model` open until `stop`, opening a new one when
    one ends; the replicas that answered go into `seen`."""
    def client() -> None:
        with requests.Session() as session:
            while not stop.is_set():
                try:
                    with session.post(router + "/v1/chat/completions", stream=True, timeout=30, json={
                            "model": model, "stream": True, "max_tokens": 400,
                            "messages": [{"role": "user", "content": "go"}]}) as resp:
                        if seen is not None and resp.status_code == 200:
                            seen.add(resp.headers["x-llmgw-replica"])
                        for _ in resp.iter_lines():
                            if stop.is_set():
                                break       # closing the response ends the request at the router
                except requests.RequestException:
                    stop.wait(0.2)          # the router between endpoint lists: try again shortly
    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    return threads


def endpoint_metrics(router: str, replica: str) -> dict[str, float]:
    """The router's own series for one replica's endpoint, by sample name, from its /metrics.

    Engine series are labelled by slot (MODEL/PROFILE/N, stable across a
    restart), not by replica id; llmgw_router_endpoint_info says which replica
    holds each slot now.
    """
    samples = [s for family in text_string_to_metric_families(requests.get(router + "/metrics", timeout=5).text)
               for s in family.samples]
    slots = {s.labels["endpoint"] for s in samples
             if s.name == "llmgw_router_endpoint_info" and s.labels.get("replica") == replica}
    return {s.name: s.value for s in samples
            if s.labels.get("endpoint") in slots and s.name != "llmgw_router_endpoint_info"}
