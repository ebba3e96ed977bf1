"""What every test package shares."""
from __future__ import annotations

import asyncio
import inspect
import os
import tempfile

import pytest

from llmgwctl.reconciler import core as _reconciler

# Every reconciler a test runs checks what its passes kept (the endpoint list,
# the desired lists, the merges skipped) against a walk of all its records
# (reconciler.core.CHECK_INCREMENTAL): in this process, and in every serve a
# test starts, which inherits the variable.
os.environ["LLMGW_CHECK_INCREMENTAL"] = "1"
_reconciler.CHECK_INCREMENTAL = True
_reconciler.EXIT_ON_MISMATCH = False         # here a mismatch raises into the test

# A serve started without --state-dir keeps its local agent's records and the
# operator's node holds (cordon, drain) under $XDG_STATE_HOME/llmgw: in a test
# run that is a directory of the run's own, so no test reads what an earlier
# run -- or the developer's own serve -- left in ~/.local/state.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="llmgw-tests-state-")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    # No pytest-asyncio among our test dependencies: run `async def` tests on a
    # fresh event loop each, which is all our tests need.
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None
