"""Which GPUs of this node a replica gets, and what the node's GPUs have free with ours running.

Pure functions over the node's GPUs and the agent's replicas: no process, no
I/O. The controller chooses GPU indices where it can; the agent checks them
(or picks the lowest free ones) and reports free memory net of its shares.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..contracts import Gpu
from .replica import Replica


def assign(r: Replica, gpus: tuple[Gpu, ...], replicas: Iterable[Replica]) -> tuple[tuple[int, ...], str]:
    """The replica's GPU indices, the controller's choice or the lowest free ones; else ((), why not)."""
    spec = r.spec
    have = {g.index for g in gpus}
    others = [o for o in replicas if o is not r and o.running]
    taken = {i for o in others for i in o.gpu_indices}
    if spec.gpu_memory_mib:
        # A replica with a memory share may sit beside others that have one:
        # the controller fitted their needs into the GPU's memory. Only a GPU
        # held whole by another replica is off limits to it.
        taken = {i for o in others if not o.spec.gpu_memory_mib for i in o.gpu_indices}
    if spec.gpu_indices:
        wanted = tuple(spec.gpu_indices)
        unknown = [i for i in wanted if i not in have]
        if unknown:
            return (), f"GPU index {unknown} does not exist here (this node has {sorted(have) or 'no GPUs'})"
        busy = [i for i in wanted if i in taken]
        if busy:
            return (), f"GPU {busy} is still held by another replica"
        return wanted, ""
    free = [i for i in sorted(have) if i not in taken]
    if len(free) < spec.gpus:
        return (), f"needs {spec.gpus} GPU(s), {len(free)} free of {len(have)}"
    return tuple(free[:spec.gpus]), ""


def free_now(gpus: tuple[Gpu, ...], replicas: Iterable[Replica]) -> tuple[Gpu, ...]:
    """The GPUs with free memory as it stands: what discovery read, less our memory shares since.

    Free memory is read once, when the agent starts (nvidia-smi, or the
    simulated SPEC). Each replica running with a memory share is taken
    off it, as the engine allocates its share: without that, placement
    would see a GPU as free as it was before anything started and could
    overfill it. A replica adopted at start was already in the figure, so
    it counts twice until the agent restarts; that errs towards not
    sharing, never towards overcommitting.
    """
    used: dict[int, int] = {}
    for r in replicas:
        if r.running and r.spec.gpu_memory_mib:
            for i in r.gpu_indices or r.spec.gpu_indices:
                used[i] = used.get(i, 0) + r.spec.gpu_memory_mib
    if not used:
        return gpus
    return tuple(dataclasses.replace(g, memory_free_mib=max(0, g.free_mib - used[g.index]))
                 if g.index in used and g.memory_mib else g for g in gpus)
