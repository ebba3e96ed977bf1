"""Router test helpers: real processes on loopback (async tests run through tests/conftest.py)."""
from __future__ import annotations

import pytest


@pytest.fixture
def engines():
    """`spawn(model, replica_id, *fake_engine_args)` -> Engine; every engine is killed at the end."""
    from .harness import spawn_engine

    started = []

    def spawn(model: str, replica_id: str, *args: str, stderr=None):
        engine = spawn_engine(model, replica_id, *args, stderr=stderr)
        started.append(engine)
        return engine

    yield spawn
    for engine in started:
        engine.kill()


@pytest.fixture
def routers():
    """`serve(router)` -> RouterThread; every router is closed at the end."""
    from .harness import RouterThread

    started = []

    def serve(router):
        rt = RouterThread(router)
        started.append(rt)
        return rt

    yield serve
    for rt in started:
        rt.close()
