"""The fake engine's driver, and `spawn()` to run one as a process.

The server itself is in `fake_server.py`; this module stays free of aiohttp so
importing the drivers costs nothing. The fake engine speaks vLLM's metrics, so
its load is read by the vLLM adapter. A member of a group spanning nodes is
launched as one of the fake's members (fake_group.py): the head serves on
the agent's port once its workers joined its rendezvous, a worker serves
nothing.

`spawn()` exists for tests and benchmarks of other pieces (router, agent,
end-to-end): it starts `llmgwctl engine fake` on a free port in its own process
group and learns the port from the server's first stdout line, so there is no
window where another process can take the port between choosing and binding.
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..contracts import GroupSlot, LoadReading, ReplicaSpec
from .base import replica_env
from .spec import Launch
from .vllm import parse_vllm


class FakeDriver:
    name = "fake"

    def launch(self, spec: ReplicaSpec, *, host: str, port: int) -> Launch:
        # LoRA as vLLM takes it: only the slots matter to the fake (engines/lora.py).
        lora = ("--max-loras", str(spec.lora_slots)) if spec.lora_slots else ()
        slot = spec.group
        if slot is None or slot.head:
            argv = fake_argv(model=spec.model, host=host, port=port, replica_id=spec.id)
        else:   # a worker serves nothing: no address of its own
            argv = (sys.executable, "-m", "llmgwctl", "engine", "fake", "--model", spec.model, "--replica-id", spec.id)
        argv += member_args(slot) + lora + tuple(spec.args)
        # No GPU check: the fake stands in for GPU engines on machines without
        # them, so a simulated inventory may hand it any indices or none.
        return Launch(argv=argv, env=replica_env(spec, check_gpus=False), health_path="/health",
                      metrics_path="/metrics" if slot is None or slot.head else None)

    def available(self) -> tuple[bool, str]:
        return True, "built in"

    def parse_metrics(self, text: str) -> LoadReading | None:
        return parse_vllm(text)


def member_args(slot: GroupSlot | None) -> tuple[str, ...]:
    """What makes a fake engine a group's member (engines/fake_group.py): its rank, and where the head listens."""
    if slot is None:
        return ()
    host = f"[{slot.head_host}]" if ":" in slot.head_host else slot.head_host
    return ("--group", slot.group, "--group-size", str(slot.size), "--rank", str(slot.rank),
            "--rendezvous", f"{host}:{slot.port}")


def fake_argv(*, model: str, host: str, port: int, replica_id: str = "") -> tuple[str, ...]:
    argv = (sys.executable, "-m", "llmgwctl", "engine", "fake", "--host", host, "--port", str(port),
            "--model", model)
    return argv + (("--replica-id", replica_id) if replica_id else ())


@dataclass
class FakeProcess:
    """A running fake engine started by `spawn()`. Stop it with `stop()` (also on failure)."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL if it is still there after `grace` seconds."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> FakeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(model: str, *args: str, host: str = "127.0.0.1", timeout: float = 30.0,
          clock: Callable[[], float] = time.monotonic) -> FakeProcess:
    """Start a fake engine on a free port; returns once it listens (not once healthy).

    `args` are extra `llmgwctl engine fake` options, e.g. ("--tokens-per-second", "20").
    `timeout` bounds the wait for the listening line; 30 s because a cold
    Python start on a loaded 2-core CI machine can take several seconds.
    """
    argv = fake_argv(model=model, host=host, port=0) + tuple(args)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None, start_new_session=True)
    try:
        port = _read_port(proc, timeout, clock)
    except BaseException:
        FakeProcess(proc, host, 0).stop()
        raise
    return FakeProcess(proc, host, port)


def _read_port(proc: subprocess.Popen[bytes], timeout: float, clock: Callable[[], float]) -> int:
    assert proc.stdout is not None
    deadline = clock() + timeout
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - clock()
            if left <= 0:
                raise TimeoutError(f"fake engine did not report its port within {timeout:.0f}s: {proc.args!r}")
            if not sel.select(min(left, 0.5)):
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                break
            line += chunk
    if not line.endswith(b"\n"):
        raise RuntimeError(f"fake engine exited with {proc.wait()} before listening: {proc.args!r}")
    # "fake engine serving MODEL on http://HOST:PORT"
    return int(line.decode().rstrip().rsplit(":", 1)[1])


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass

