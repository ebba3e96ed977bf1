"""Each node's desired replicas, and the long-poll agents wait on.

The reconciler writes a node's list only when it changed; an agent's
`GET .../desired?after=V` is answered at once when the node's version differs
from V (agents take any different version as news), otherwise when it changes
or after a timeout. Versions start from the controller's start time in
milliseconds, so a restarted controller never hands out a version an agent
still holds from the previous one.

A node's list is not served at all until the reconciler has set it once: an
agent takes its first answer as the whole truth, so answering before its
report was read and its running replicas adopted would tell it to stop them.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from ..aio import Waiters
from ..contracts import ReplicaSpec

# Held long-polls answer after 30 s with no change: well inside the agent's 45 s
# client timeout, and short enough that proxies and NAT don't drop idle requests.
LONG_POLL = 30.0


class DesiredStore:
    def __init__(self, first_version: int | None = None) -> None:
        # Not 1 but this process's start time in ms (tests may pin it): an agent
        # ignores a version equal to the one it holds, and a restarted controller
        # counting from 1 again handed it exactly that number with a different
        # list -- without a model removed while the controller was down -- so
        # the removed model's engine ran on, unwatched by anyone, for good.
        self._versions = itertools.count(first_version if first_version is not None else int(time.time() * 1000))
        self._lists: dict[str, tuple[int, tuple[ReplicaSpec, ...], str]] = {}
        # The long-polls held per node, resumed by a change in one step of the loop
        # (aio.Waiters): a rollout answers a thousand nodes at once (issue 19).
        self._waiters: dict[str, Waiters] = {}

    def set(self, node: str, specs: Iterable[ReplicaSpec]) -> bool:
        """Make `specs` the node's desired list; True if that changed it."""
        specs = tuple(sorted(specs, key=lambda s: s.id))
        # Adapters are outside the hash but in the list: a change loads or unloads one on the node.
        fingerprint = "|".join(f"{s.id}:{s.spec_hash}:{s.gpu_indices}" + (_adapters(s) if s.adapters else "")
                               for s in specs)
        current = self._lists.get(node)
        if current is not None and current[2] == fingerprint:
            return False
        self._lists[node] = (next(self._versions), specs, fingerprint)
        self.wake(node)
        return True

    def wake(self, node: str) -> None:
        """Answer the node's held long-polls now, with its list as it is (a change, or the control API's log requests)."""
        waiters = self._waiters.pop(node, None)
        if waiters is not None:
            waiters.wake()

    def get(self, node: str) -> tuple[int, tuple[ReplicaSpec, ...]] | None:
        entry = self._lists.get(node)
        return (entry[0], entry[1]) if entry else None

    async def wait(self, node: str, after: int | None, timeout: float = LONG_POLL) -> tuple[int, tuple[ReplicaSpec, ...]] | None:
        """The node's list once its version differs from `after`; None on timeout before it is known."""
        entry = self.get(node)
        if (entry is not None and entry[0] != after) or timeout <= 0:
            return entry
        waiters = self._waiters.setdefault(node, Waiters())
        try:
            await waiters.wait(timeout)
        finally:
            if not waiters and self._waiters.get(node) is waiters:
                del self._waiters[node]
        return self.get(node)


def _adapters(spec: ReplicaSpec) -> str:
    return ":" + ",".join(f"{a.name}={a.source}" for a in spec.adapters)
