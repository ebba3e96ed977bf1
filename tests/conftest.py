"""What every test package shares."""
from __future__ import annotations

import asyncio
import inspect

import pytest

from llmgwctl.reconciler import core as _reconciler

# Every reconciler a test runs in this process checks its kept endpoint list
# against a walk of all its records on each publish (reconciler.core.CHECK_INCREMENTAL).
_reconciler.CHECK_INCREMENTAL = True


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    # No pytest-asyncio among our test dependencies: run `async def` tests on a
    # fresh event loop each, which is all our tests need.
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None
