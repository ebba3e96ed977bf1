"""Fixtures for engine tests: fake engines as real processes, killed even on failure; a vLLM driver that finds a stand-in."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import requests

from llmgwctl.engines import vllm as vllm_driver
from llmgwctl.engines.fake import FakeProcess, spawn
from llmgwctl.engines.vllm import VllmDriver

from ..support import wait_until


@pytest.fixture
def fake_engine() -> Iterator[Callable[..., FakeProcess]]:
    """`fake_engine(model, *extra_args)` starts one; all are stopped at teardown."""
    started: list[FakeProcess] = []

    def start(model: str = "fake-model", *args: str) -> FakeProcess:
        proc = spawn(model, *args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def wait_healthy(url: str, timeout: float = 20.0) -> None:
    def healthy() -> bool:
        try:
            return requests.get(f"{url}/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False
    wait_until(healthy, f"{url}/health", timeout)


@pytest.fixture
def vllm_here(tmp_path, monkeypatch):
    """A VllmDriver whose module is importable here (a stand-in, never imported), run by /opt/py/bin/python."""
    pkg = tmp_path / "site" / "standin_vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the driver must not import vLLM')\n")
    monkeypatch.syspath_prepend(str(pkg.parent))
    # Which distribution provides it: none this machine has, unless a test says.
    monkeypatch.setattr(vllm_driver, "DISTRIBUTIONS", ("standin-vllm",))
    return VllmDriver(module="standin_vllm", python="/opt/py/bin/python")
