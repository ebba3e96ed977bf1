"""Router test helpers: async tests without a plugin, and real processes on loopback."""
from __future__ import annotations

import asyncio
import inspect

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    # No pytest-asyncio among our test dependencies: run `async def` tests on a
    # fresh event loop each, which is all these tests need.
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None


@pytest.fixture
def engines():
    """`spawn(model, replica_id, *fake_engine_args)` -> Engine; every engine is killed at the end."""
    from .harness import spawn_engine

    started = []

    def spawn(model: str, replica_id: str, *args: str):
        engine = spawn_engine(model, replica_id, *args)
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
