"""Stopping an engine's process group: SIGTERM, a grace period, SIGKILL, reaped.

Every engine runs in its own process group (procs.spawn), so its workers --
which may hold GPU memory -- stop with it. Nothing is signalled unless it is
provably ours (procs.group_is_ours): a pid reused by another process is left
alone. It knows nothing of replicas' states; the core decides what to stop.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
from collections.abc import Callable

from . import procs

log = logging.getLogger("llmgw.agent")

# 15 s between SIGTERM and SIGKILL: vLLM and SGLang need a few seconds to stop
# their worker processes and release GPU memory, and a replica is already out
# of the router (drained) before the controller asks for the stop; an engine
# still up after that is wedged, and holding its GPUs longer helps nobody.
STOP_GRACE = 15.0
# After SIGKILL the kernel tears a group down in well under a second; 5 s
# bounds the wait so a process stuck in uninterruptible I/O (D state) cannot
# wedge a stop. It is logged and the group is reported as still there.
KILL_WAIT = 5.0


async def stop_if_ours(rid: str, pgid: int, started: int, popen: subprocess.Popen[bytes] | None, grace: float,
                       clock: Callable[[], float]) -> None:
    """Stop group `pgid` if its leader is still the process started at `started`; reap `popen`."""
    if await asyncio.to_thread(procs.group_is_ours, pgid, started):
        await signal_and_wait(rid, pgid, popen, grace, clock)
    else:
        log.warning("replica %s: pid %d is now another process; not signalling it", rid, pgid)


async def signal_and_wait(rid: str, pgid: int, popen: subprocess.Popen[bytes] | None, grace: float,
                          clock: Callable[[], float]) -> None:
    """SIGTERM the group, SIGKILL what is left after `grace`, each wait bounded; reap the leader as it goes."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT)):
        if not await asyncio.to_thread(procs.signal_group, pgid, sig):
            return
        if sig == signal.SIGTERM:
            # A stopped process acts on SIGTERM only once continued (systemd
            # sends SIGCONT after its stop signal for the same reason): an
            # engine stopped by SIGSTOP then shuts down cleanly instead of
            # being killed after the grace period.
            await asyncio.to_thread(procs.signal_group, pgid, signal.SIGCONT)
        deadline = clock() + wait
        while True:
            if popen is not None:
                popen.poll()   # reap the leader as soon as it exits, or it lingers as a zombie
            if not await asyncio.to_thread(procs.group_members, pgid):
                return
            if clock() >= deadline:
                break
            await asyncio.sleep(0.1)
        if sig == signal.SIGTERM:
            log.warning("replica %s: still running %.0fs after SIGTERM; sending SIGKILL", rid, wait)
    log.error("replica %s: process group %d survived SIGKILL (stuck in the kernel?)", rid, pgid)


async def clear_leftovers(rid: str, pgid: int, grace: float, clock: Callable[[], float]) -> None:
    """Kill what an engine that died while no agent watched left in its group.

    Its worker processes may still hold GPU memory. They are ours beyond
    doubt only if the leader's pid is not in use at all (see
    procs.group_is_ours); a reused pid means the group is long gone.
    """
    leader_free = await asyncio.to_thread(procs.start_time, pgid) is None
    # len(): with a bare list after `and`, mypy infers group_members as if it returned bool.
    if leader_free and len(await asyncio.to_thread(procs.group_members, pgid)) > 0:
        log.warning("replica %s: its engine died while the agent was down; stopping what it left "
                    "in process group %d", rid, pgid)
        await signal_and_wait(rid, pgid, None, grace, clock)
