"""The test fleet's teardown finds processes that lost their marker: vLLM's engine workers rename
themselves (setproctitle overwrites the environment /proc shows), and left behind they hold gigabytes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .fleet import Fleet, alive, wait_until

# A parent carrying the marker starts a child with an empty environment (what
# a renamed worker looks like from /proc), prints its pid and waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env={})
print(child.pid, flush=True)
time.sleep(120)
"""


def start_parent(fleet: Fleet) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env={**os.environ, "LLMGW_TEST_MARK": fleet.mark},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def test_close_kills_a_marked_process_child_without_the_marker(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    parent, child = start_parent(fleet)
    try:
        assert {parent.pid, child} <= set(fleet.marked_pids())
    finally:
        fleet.close_checked()
        parent.wait(timeout=10)
    assert not alive(child)


def test_close_kills_an_orphan_in_a_session_seen_before(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    parent, child = start_parent(fleet)
    try:
        assert child in fleet.marked_pids()
        os.kill(parent.pid, signal.SIGKILL)     # the API server dies first; its worker is reparented
        parent.wait(timeout=10)
        wait_until(lambda: child in fleet.marked_pids(), "the orphan still counted as the fleet's", timeout=10)
    finally:
        fleet.close_checked()
    assert not alive(child)
