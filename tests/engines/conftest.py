"""Fixtures for engine tests: fake engines as real processes, killed even on failure."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import requests

from llmgwctl.engines.fake import FakeProcess, spawn

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
