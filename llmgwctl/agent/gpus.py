"""Which GPUs this node has: from nvidia-smi, from a simulated SPEC, or none.

Owns the three ways of getting a node's inventory (the `Gpu` record is a
contract: the inventory reads the same type from reports). It
must not know about replicas or placement: it only says what is there.
"""
from __future__ import annotations

import logging
import re
import shutil
import subprocess
import uuid

from ..contracts import Gpu
from .errors import GpuSpecError as GpuSpecError  # re-exported: the CLI catches what parse_spec raises from here

log = logging.getLogger("llmgw.agent.gpus")

# Free memory is read with the rest: placement fits profiles that state their
# memory into what is free, which includes what processes outside llmgw hold.
NVIDIA_SMI_QUERY = ("--query-gpu=index,uuid,name,memory.total,memory.free", "--format=csv,noheader,nounits")

SPEC_FORM = ("COUNTxNAME-MEMGB[:FREEGB][,...], e.g. 4xH100-80GB, 2xA100-80GB,1xL4-24GB, "
             "or 1xL4-24GB:16GB for an L4 with 16 GB of its 24 free")
_SPEC_PART = re.compile(r"^\s*(\d+)\s*[xX]\s*([A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?)-(\d+)GB(?::(\d+)GB)?\s*$")

# A fixed namespace so a simulated inventory gets the same uuids on every run
# (and a different set per node name): reports and state files stay comparable.
_SIM_NAMESPACE = uuid.UUID("6c6c6d67-772d-7369-6d2d-677075000000")


def parse_spec(spec: str, node: str = "") -> tuple[Gpu, ...]:
    """`2xA100-80GB,1xL4-24GB` -> three simulated GPUs, indices 0.. in order.

    Free memory is the total unless the part says otherwise (`1xL4-24GB:16GB`),
    which simulates memory held by something outside llmgw.
    """
    gpus: list[Gpu] = []
    parts = spec.split(",")
    for part in parts:
        m = _SPEC_PART.match(part)
        if not m or int(m.group(1)) < 1 or int(m.group(3)) < 1 or int(m.group(4) or 0) > int(m.group(3)):
            raise GpuSpecError(f"GPU spec {spec!r}: part {part.strip()!r} is not understood; expected {SPEC_FORM}")
        count, name, gb = int(m.group(1)), m.group(2), int(m.group(3))
        free_gb = int(m.group(4)) if m.group(4) is not None else gb
        for _ in range(count):
            index = len(gpus)
            fake = uuid.uuid5(_SIM_NAMESPACE, f"{node}/{index}/{name}-{gb}GB")
            gpus.append(Gpu(index=index, uuid=f"GPU-{fake}", name=f"{name}-{gb}GB", memory_mib=gb * 1024,
                            memory_free_mib=free_gb * 1024))
    return tuple(gpus)


def parse_nvidia_smi(text: str) -> tuple[Gpu, ...]:
    """Parse `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.free --format=csv,noheader,nounits`.

    Lines look like `0, GPU-5f0c..., NVIDIA H100 80GB HBM3, 81559, 80873`. A name
    could hold a comma, so index and uuid come from the left and the two memory
    columns from the right.
    """
    gpus = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 5:
            raise ValueError(f"nvidia-smi line {lineno}: expected 'index, uuid, name, memory total, memory free', "
                             f"got {line!r}")
        try:
            index, memory, free = int(fields[0]), int(float(fields[-2])), int(float(fields[-1]))
        except ValueError:
            raise ValueError(f"nvidia-smi line {lineno}: index and memory must be numbers, got {line!r}") from None
        gpus.append(Gpu(index=index, uuid=fields[1], name=", ".join(fields[2:-2]), memory_mib=memory,
                        memory_free_mib=free))
    return tuple(sorted(gpus, key=lambda g: g.index))


def discover(mode: str, node: str = "") -> tuple[Gpu, ...]:
    """`auto` asks nvidia-smi, `none` is a CPU-only node, anything else is a SPEC.

    Blocking (runs a process): call it from a worker thread on a running loop.
    """
    if mode == "none":
        return ()
    if mode != "auto":
        return parse_spec(mode, node)
    exe = shutil.which("nvidia-smi")
    if exe is None:
        log.info("nvidia-smi not found on PATH: this node reports no GPUs (use --gpus SPEC to simulate some)")
        return ()
    try:
        # 30 s: nvidia-smi can take seconds per GPU while the driver wakes idle
        # devices; longer than that means a wedged driver, and no GPUs is then the honest answer.
        out = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30, check=True)
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("nvidia-smi failed (%s): this node reports no GPUs", exc)
        return ()
    return parse_nvidia_smi(out.stdout)
