"""Ports and process groups, for the tests and the benches alike.

    free_port    a port on 127.0.0.1 that was free a moment ago
    kill_group   SIGKILL a child's whole process group, then reap the child
    stop_group   SIGTERM the group, SIGKILL it after a grace period, reap the child

Children are started with `start_new_session=True`, so each leads a group of
its own and anything it starts (an engine under an agent, a router's helper)
goes down with it. Only the standard library here: `bench/` imports this
without the test extra.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import AnyStr

# How long a killed child takes to be reaped: it is dying already, so ten
# seconds only matters on a machine that is badly overloaded.
REAP_TIMEOUT = 10.0


def free_port() -> int:
    """A port on 127.0.0.1 that was free when asked, for a program that cannot report the port it bound.

    Another process may take it before the caller binds it; on loopback, in
    the moment between, that does not happen in practice.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _signal_group(proc: subprocess.Popen[AnyStr], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:      # the group ended between the poll and the signal
        pass


def kill_group(proc: subprocess.Popen[AnyStr], timeout: float = REAP_TIMEOUT) -> None:
    """SIGKILL `proc`'s process group if `proc` still runs, then wait for `proc` (at most `timeout` s)."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGKILL)
    proc.wait(timeout)


def stop_group(proc: subprocess.Popen[AnyStr], grace: float) -> None:
    """SIGTERM `proc`'s group so it can stop cleanly; SIGKILL it if `proc` has not ended within `grace` s."""
    if proc.poll() is not None:
        return
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
