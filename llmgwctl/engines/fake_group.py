"""The fake engine as a member of a replica spanning nodes: the head's rendezvous, a worker's join.

A real multi-node engine's head waits in its rendezvous (torch.distributed's
master port) until every worker joined, serves only then, and dies when a
rank dies; its workers serve nothing and die with the head. The fake plays
exactly that, so the gang semantics above it (all members or none, one
failure is the group's) are tested with real processes and no GPU.

The protocol, on the head's rendezvous port (TCP):

    worker -> head   join GROUP RANK\\n         one line, within HELLO_TIMEOUT, at most MAX_LINE bytes
    head -> worker   welcome\\n | refused: WHY\\n  (then the head closes)

After the welcome both keep the connection open and send nothing more: its
end is the other member's end. The head is whole when ranks 1 .. size-1 have
joined, each once; a second claim of a rank, a rank out of range, another
group's id or a line that is not a join is refused, and the head carries on.
What a worker sends after its welcome is read and dropped, a bounded read at
a time. A worker that leaves (its process died: the kernel closes its
socket) breaks the group: the head exits non-zero. The head's leaving ends
every worker the same way. Both bound their wait for the other to appear
(`join_timeout`): a member whose group never forms exits rather than hangs.

Nothing here imports another llmgwctl subpackage: it is part of an engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from typing import NoReturn

# A join line is a few dozen bytes; more is not a member speaking.
MAX_LINE = 256
# How long a connection may take to say its join line: a worker sends it the
# moment it connects; a silent connection (a port scan) is dropped, not waited on.
HELLO_TIMEOUT = 5.0
# Between a worker's attempts to reach a head that is not listening yet: the
# members start side by side, from different agents.
RETRY_EVERY = 0.2
# What a member exits with when its group breaks: any non-zero code that is not a signal.
BROKEN_CODE = 4


class GroupBroken(Exception):
    """This member's group cannot form or has lost a member; the message says which and why."""


class Rendezvous:
    """The head's side: accepts the workers' joins and notices the first one to leave."""

    def __init__(self, group: str, size: int, clock: Callable[[], float] = time.monotonic):
        self.group = group
        self.size = size
        self.clock = clock
        self.joined: dict[int, asyncio.StreamWriter] = {}
        self.broken = asyncio.Event()
        self.why = ""
        self._server: asyncio.Server | None = None

    @property
    def waiting(self) -> int:
        """Workers that have not joined yet."""
        return self.size - 1 - len(self.joined)

    @property
    def whole(self) -> bool:
        return self.waiting == 0 and not self.broken.is_set()

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._member, host, port, limit=MAX_LINE)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self.joined.values():
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def watch(self, timeout: float) -> None:
        """Break the group if it is not whole within `timeout` (a member that never came is a dead rank)."""
        deadline = self.clock() + timeout
        while not self.whole and not self.broken.is_set():
            if self.clock() >= deadline:
                self.why = f"group {self.group}: {self.waiting} worker(s) did not join within {timeout:g} s"
                self.broken.set()
                return
            await asyncio.sleep(min(RETRY_EVERY, max(0.0, deadline - self.clock())))

    async def _member(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = await self._hello(reader, writer)
        if rank is None:
            writer.close()
            return
        try:
            while await reader.read(MAX_LINE):
                pass   # nothing is expected after the welcome: read and dropped, a bounded read at a time
        except OSError:
            pass
        if self.joined.get(rank) is writer and not self.broken.is_set():
            self.why = f"group {self.group}: worker rank {rank} left the group"
            self.broken.set()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int | None:
        """The joining worker's rank, welcomed; None (after telling it why, if it listens) when refused."""
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT)
        except (asyncio.TimeoutError, ValueError, OSError):   # silent, or a line past MAX_LINE
            return None
        words = line.decode("ascii", "replace").split()
        why = ""
        rank = -1
        if len(words) != 3 or words[0] != "join" or not words[2].isdigit():
            why = "expected 'join GROUP RANK'"
        elif words[1] != self.group:
            why = f"this is group {self.group}, not {words[1][:64]}"
        elif not 1 <= (rank := int(words[2])) < self.size:
            why = f"rank {words[2][:8]} is not a worker's rank in a group of {self.size}"
        elif rank in self.joined:
            why = f"rank {rank} has joined already"
        elif self.broken.is_set():
            why = "the group is broken"
        try:
            writer.write(f"refused: {why}\n".encode() if why else b"welcome\n")
            await asyncio.wait_for(writer.drain(), HELLO_TIMEOUT)
        except (asyncio.TimeoutError, OSError):
            return None
        if why:
            return None
        self.joined[rank] = writer
        return rank


async def join(group: str, rank: int, host: str, port: int, timeout: float,
               clock: Callable[[], float] = time.monotonic) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A worker's side: reach the head's rendezvous (retrying until `timeout`) and be welcomed.

    GroupBroken if the head is not there in time or refuses the join.
    """
    deadline = clock() + timeout
    last = ""
    while True:
        left = deadline - clock()
        if left <= 0:
            raise GroupBroken(f"group {group}: the head at {host}:{port} did not welcome rank {rank} "
                              f"within {timeout:g} s (last: {last or 'no answer'})")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_LINE),
                                                    min(left, HELLO_TIMEOUT))
        except (asyncio.TimeoutError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(min(RETRY_EVERY, max(0.0, deadline - clock())))
            continue
        try:
            writer.write(f"join {group} {rank}\n".encode())
            answer = await asyncio.wait_for(reader.readline(), min(max(left, 0.1), HELLO_TIMEOUT))
        except (asyncio.TimeoutError, ValueError, OSError) as exc:
            writer.close()
            last = f"no welcome: {type(exc).__name__}"
            await asyncio.sleep(RETRY_EVERY)
            continue
        if answer == b"welcome\n":
            return reader, writer
        writer.close()
        raise GroupBroken(f"group {group}: the head at {host}:{port} refused rank {rank}: "
                          f"{answer.decode('ascii', 'replace').strip()[:MAX_LINE] or 'closed'}")


async def until_head_leaves(reader: asyncio.StreamReader) -> None:
    """Return when the head's end of a joined connection closes (what it sends is dropped, bounded)."""
    with contextlib.suppress(OSError):
        while await reader.read(MAX_LINE):
            pass


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT (or [V6]:PORT) -> (host, port); ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"rendezvous {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


async def serve_worker(group: str, rank: int, rendezvous: str, timeout: float, stop: asyncio.Event) -> None:
    """Run as worker `rank`: join the head at `rendezvous`, then live until the head leaves or `stop` is set.

    GroupBroken when it cannot join or the head left: the worker's process exits non-zero.
    """
    host, port = parse_address(rendezvous)
    joining = asyncio.ensure_future(join(group, rank, host, port, timeout))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({joining, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not joining.done():
            return
        reader, writer = joining.result()
        print(f"fake engine worker rank {rank} joined group {group} at {host}:{port}", flush=True)
        leaving = asyncio.ensure_future(until_head_leaves(reader))
        try:
            await asyncio.wait({leaving, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            writer.close()
        if leaving.done() and not stop.is_set():
            raise GroupBroken(f"group {group}: the head at {host}:{port} left the group")
    finally:
        joining.cancel()
        stopped.cancel()


def exit_broken(why: str) -> NoReturn:
    """End this member's process as a rank's death ends a real engine's: one line on stderr, a non-zero code."""
    print(f"ERROR {why}", file=sys.stderr, flush=True)
    raise SystemExit(BROKEN_CODE)
