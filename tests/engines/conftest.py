"""Fixtures for engine tests: fake engines as real processes, killed even on failure."""
from __future__ import annotations

import time
from typing import Callable, Iterator

import pytest
import requests

from llmgwctl.engines.fake import FakeProcess, spawn


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


def wait_for(check: Callable[[], object], timeout: float = 20.0, interval: float = 0.05, what: str = "") -> object:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what or check}; last value {last!r}")


def wait_healthy(url: str, timeout: float = 20.0) -> None:
    def healthy() -> bool:
        try:
            return requests.get(f"{url}/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False
    wait_for(healthy, timeout, what=f"{url}/health")
