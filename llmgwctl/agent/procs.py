"""Engine processes as the kernel sees them: start, identify, signal, read logs.

Owns everything that touches `/proc`, process groups and per-replica log files.
Every function here blocks (reads /proc, forks, writes files): callers on the
event loop run them in a worker thread. It must not know about replicas,
specs or the controller.

Identity: a pid alone is not a process -- after an engine dies the kernel may
hand its pid to something else. A process is (pid, start time), the start time
being field 22 of /proc/PID/stat in clock ticks since boot; both together are
never reused within one boot, and the state file records the boot id to rule
out the next one.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# 8 MiB live + one rotated copy per replica: enough to hold a full startup
# (vLLM prints a few hundred KiB while loading) plus hours of request logs, and
# a crash-looping engine can never fill the node's disk. See rotate_log for why
# rotation is copy-then-truncate.
LOG_CAP_BYTES = 8 * 1024 * 1024
# Lines of the log sent with every report: enough for a Python traceback's
# tail, small enough that a heartbeat stays a few KiB per replica.
LOG_TAIL_LINES = 20


def boot_id() -> str:
    """This machine's boot id: changes on every reboot, so old pids mean nothing."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # comm (field 2) is in parentheses and may contain spaces or ')': split after the last ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    return rest  # rest[0] is field 3 (state), so field N is rest[N - 3]


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time, clock ticks after boot); None if no such process."""
    fields = _stat_fields(pid)
    return int(fields[22 - 3]) if fields else None


def is_same_process(pid: int, started: int) -> bool:
    """Whether `pid` is still the process that started at `started` (and not a zombie)."""
    fields = _stat_fields(pid)
    if not fields:
        return False
    return fields[0] != "Z" and int(fields[22 - 3]) == started


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # field 5 is pgrp; zombies are already dead and only wait for a reaper.
        if fields and fields[0] != "Z" and int(fields[5 - 3]) == pgid:
            members.append(int(entry.name))
    return members


def group_is_ours(pgid: int, started: int) -> bool:
    """Whether signalling group `pgid` can only reach what we started.

    Either its leader is still the very process we started, or the leader is
    gone entirely: Linux never hands out a pid that is still some group's id,
    so any member left is a child of our engine. A live leader with another
    start time means the pid was reused and our group is long gone.
    """
    fields = _stat_fields(pgid)
    if fields is None:
        return True
    return fields[0] == "Z" or int(fields[22 - 3]) == started


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False if nothing in it was left to receive it."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _private(path: str, flags: int) -> int:
    """An `open` opener creating files 0600, and tightening one an older agent made looser."""
    fd = os.open(path, flags, 0o600)
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


@dataclass(frozen=True, slots=True)
class Spawned:
    popen: subprocess.Popen[bytes]
    pid: int
    start_time: int


def resolve_program(program: str) -> str:
    """The file `program` (an engine's argv[0]) runs: itself if it is a path, else found on the agent's own PATH.

    Never on the engine's PATH: Python's subprocess looks a bare name up on
    the PATH of the environment it is given, which holds the replica's env,
    and that is the catalog's to write. Where the engine's program is found is
    the node's choice; FileNotFoundError if this node has none.
    """
    if os.sep in program:
        return program
    found = shutil.which(program, path=os.environ.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, "not found on the agent's PATH", program)
    return os.path.abspath(found)


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path | None = None) -> Spawned:
    """Start argv in its own session (so its own process group) with output to log_path.

    Its own session: a SIGKILL of the agent, or a Ctrl-C in the agent's
    terminal, never reaches the engine, and stopping it is one killpg. The log
    is opened O_APPEND so that after rotate_log truncates it the engine's next
    write lands at the new end instead of leaving a hole of zeros.
    """
    program = resolve_program(argv[0])
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # 0600: an engine's log holds what it prints about requests (prompts, in
    # some engines' debug output) and tracebacks; only the agent's user reads it.
    with open(log_path, "ab", buffering=0, opener=_private) as out:
        popen = subprocess.Popen(list(argv), executable=program, env=dict(env), stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                 cwd=cwd)
    started = start_time(popen.pid)
    if started is None:   # exited before we could look: still report it through poll()
        started = -1
    return Spawned(popen=popen, pid=popen.pid, start_time=started)


def rotate_log(path: Path, cap: int = LOG_CAP_BYTES) -> bool:
    """Keep a replica's log under `cap`: copy it to PATH.1, then truncate it in place.

    Copy-then-truncate (logrotate's copytruncate) because the engine holds the
    file open for its whole life -- also across an agent restart, when nobody
    could hand it a new file -- so the file itself must shrink. Lines written
    between the copy and the truncate are lost; for a diagnostic log that is
    the right trade against ever restarting an engine to rotate it.
    """
    try:
        if path.stat().st_size <= cap:
            return False
        with open(path, "rb") as src, open(path.with_name(path.name + ".1"), "wb", opener=_private) as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.truncate(path, 0)
    except FileNotFoundError:
        return False
    return True


def tail(path: Path, lines: int = LOG_TAIL_LINES, max_bytes: int = 16384) -> list[str]:
    """The last `lines` lines of a log, decoded leniently (engines print anything)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return []
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and text:
        text = text[1:]   # the first line was cut by the seek
    return text[-lines:]

