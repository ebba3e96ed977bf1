"""Memory sizes as operators write them: `20GiB`, `512MiB`, `1.5TiB`, or decimal `24GB` as vendors print them.

Everything becomes MiB, the unit nvidia-smi and the agent report GPU memory
in, so a profile's need and a GPU's size compare without conversion. Decimal
units (MB, GB, TB: powers of ten, what a GPU's box says) are converted and
rounded up, so a need written `20GB` never ends below what was meant.
"""
from __future__ import annotations

import math
import re

_UNITS_MIB = {"mib": 1.0, "gib": 1024.0, "tib": 1024.0 * 1024,
              "mb": 1e6 / 2**20, "gb": 1e9 / 2**20, "tb": 1e12 / 2**20}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(mib|gib|tib|mb|gb|tb)\s*$", re.IGNORECASE)

EXPECTED = "a size like 20GiB, 512MiB or 24GB"


def parse_size_mib(value: object) -> int:
    """MiB in `value` (rounded up); ValueError naming what was expected when it is not a size."""
    if not isinstance(value, str):
        raise ValueError(f"expected {EXPECTED}, got {type(value).__name__}")
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"expected {EXPECTED}, got {value!r}")
    mib = float(m.group(1)) * _UNITS_MIB[m.group(2).lower()]
    if not math.isfinite(mib):
        raise ValueError(f"expected {EXPECTED}, got {value!r}, which is not a finite size")
    return math.ceil(mib - 1e-9)


def format_size_mib(mib: int) -> str:
    """`20480` -> `20GiB`, `1536` -> `1.5GiB`, `500` -> `500MiB`: parses back to the same number."""
    if mib >= 1024 and mib % 1024 == 0:
        return f"{mib // 1024}GiB"
    if mib >= 1024 and (mib * 10) % 1024 == 0:
        return f"{mib / 1024:g}GiB"
    return f"{mib}MiB"


def human_mib(mib: int) -> str:
    """For messages: whole GiB when it is at least 1 GiB (`16 GiB`, `22.5 GiB`), else MiB."""
    if mib >= 1024:
        return f"{round(mib / 1024, 1):g} GiB"
    return f"{mib} MiB"
