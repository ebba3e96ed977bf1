"""How many replicas that use no GPU this node takes: what the agent reports as `cpu` (contracts.CpuCapacity).

A GPU replica is bounded by the node's GPUs; a CPU replica (a profile with
`gpus: 0`) by nothing the catalog states, so without a bound placement would
pile every CPU model of a catalog onto the first node that runs its engine --
a process and a port each, far past what the machine can run. The agent
knows its machine, so it says how many: its operator's --max-cpu-replicas,
else a default from its cores and memory; never more than its port range holds.
"""
from __future__ import annotations

import logging
import os

from ..contracts import CpuCapacity
from ..contracts.report import MAX_CPU_REPLICAS
from .ports import PortRange

log = logging.getLogger("llmgw.agent")

# The default is per core: a CPU replica serving a small model (the bundled
# smollm2 on llama.cpp, a fake engine) is idle between requests and the
# kernel time-shares the cores among them, so a few per core keep each one
# answering; past 4 per core a busy node gives each less than a quarter of a
# core, which no model worth serving on a CPU answers in time. An operator
# who runs only light engines raises it with --max-cpu-replicas, one running
# big llama.cpp models (each wanting every core) lowers it. A 2-core machine
# gets 8: the README's two CPU models run with room for more.
CPU_REPLICAS_PER_CORE = 4
# ...and per memory: the least a CPU engine holding a model takes (the
# smallest GGUF in llama.cpp is ~200 MiB resident, the fake ~40 MiB), so a
# machine with little memory for its cores is not told to run more engines
# than it can hold.
MIB_PER_CPU_REPLICA = 256


def cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or a taskset's, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def memory_mib() -> int:
    """The machine's memory in MiB; 0 when the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (AttributeError, ValueError, OSError):
        return 0


def cpu_capacity(ports: PortRange, max_cpu_replicas: int | None = None, *,
                 n_cores: int | None = None, mib: int | None = None) -> CpuCapacity:
    """This node's CPU capacity: `max_cpu_replicas` if the operator gave it, else the default; capped by `ports`."""
    n_cores = cores() if n_cores is None else n_cores
    mib = memory_mib() if mib is None else mib
    if max_cpu_replicas is None:
        limit = CPU_REPLICAS_PER_CORE * max(1, n_cores)
        if mib:
            limit = min(limit, max(1, mib // MIB_PER_CPU_REPLICA))
    else:
        limit = max_cpu_replicas
    # Every replica listens on a port of its own, GPU replicas too; a CPU
    # replica past the range could only fail to start, again and again.
    if limit > len(ports):
        if max_cpu_replicas is not None:
            log.warning("--max-cpu-replicas %d is more than the %d ports of %s: %d CPU replicas at most",
                        max_cpu_replicas, len(ports), ports, len(ports))
        limit = len(ports)
    return CpuCapacity(cores=min(n_cores, 65_536), memory_mib=min(mib, 1 << 32),
                       max_replicas=min(limit, MAX_CPU_REPLICAS))
