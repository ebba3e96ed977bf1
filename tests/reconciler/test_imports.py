"""The reconciler is importable without the router: the layers hold at import time, not only on paper."""
from __future__ import annotations

import os
import subprocess
import sys

# Run in a fresh interpreter: this test process has long since imported aiohttp.
CHECK = """
import sys
import llmgwctl.reconciler
loaded = sorted(m for m in sys.modules if m == "aiohttp" or m.startswith(("aiohttp.", "llmgwctl.router")))
assert not loaded, loaded
"""


def test_importing_the_reconciler_loads_neither_aiohttp_nor_the_router():
    # Bounded: an import takes well under a second; 60 s only guards a hung interpreter.
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert done.returncode == 0, done.stderr
