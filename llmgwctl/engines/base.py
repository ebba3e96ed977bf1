"""What every driver shares: the environment a replica gets, and reading /metrics.

The environment rule lives here once, because getting it wrong in one driver
would let an engine grab GPUs placement gave to another replica.

Metrics pages are parsed with prometheus_client's own parser, so the text
format's corners (escaping, timestamps, `# EOF`, histograms out of order as
SGLang's multiprocess mode prints them) are not ours to get right. Adapters
pick samples by *sample* name, not family name: the parser strips `_total`
and friends from family names, never from sample names.

Only the lines of the wanted samples reach the parser: a page is an
engine's to fill, and a million series of families no adapter reads must
cost a scan for a few names (`str.find`, in C), not a million parsed lines.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

from ..contracts import ReplicaSpec
from .errors import LaunchError


def replica_env(spec: ReplicaSpec, *, check_gpus: bool = True) -> Mapping[str, str]:
    """The profile's env plus CUDA_VISIBLE_DEVICES from the replica's GPU indices.

    CUDA_VISIBLE_DEVICES is set last so a profile cannot override it: the
    agent, not the profile, decides which devices a replica owns. A 0-GPU
    replica gets it set to "" (no device visible), so a CPU profile never
    grabs a GPU another replica was placed on.
    """
    if check_gpus and len(spec.gpu_indices) != spec.gpus:
        raise LaunchError(
            f"replica {spec.id}: profile {spec.profile!r} needs {spec.gpus} GPU(s) but was given "
            f"indices {list(spec.gpu_indices)}; the agent must assign exactly {spec.gpus}")
    env = dict(spec.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    return MappingProxyType(env)


# Sample lines of the wanted names a page may hold: vLLM prints one per engine
# core and SGLang one per rank, a few dozen at most even with data
# parallelism across a large node. More is not a page to weigh a pick by.
MAX_SAMPLE_LINES = 4096


def sample_lines(text: str, names: Iterable[str], limit: int = MAX_SAMPLE_LINES) -> list[str] | None:
    """The lines of `text` that are samples of `names` (the name, then `{`, a space or a tab), in
    page order; None past `limit` of them. Comments and every other family are skipped unread."""
    page = "\n" + text        # every line, the first too, starts after a newline
    starts: list[int] = []
    for name in set(names):
        needle = "\n" + name
        follow = len(needle)
        at = page.find(needle)
        while at >= 0:
            if page[at + follow:at + follow + 1] in ("{", " ", "\t"):
                starts.append(at + 1)
                if len(starts) > limit:
                    return None
            at = page.find(needle, at + follow)
    starts.sort()
    lines = []
    for at in starts:
        end = page.find("\n", at)
        lines.append(page[at:end if end >= 0 else len(page)].rstrip("\r"))
    return lines


def samples(text: str, names: Iterable[str]) -> dict[str, list[tuple[dict[str, str], float]]] | None:
    """Every sample of the wanted names, with labels; None if their lines do not parse, or are past MAX_SAMPLE_LINES.

    NaN samples are dropped: a gauge not yet set says nothing about load.
    """
    wanted = set(names)
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    lines = sample_lines(text, wanted)
    if lines is None:
        return None
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name in wanted and not math.isnan(sample.value):
                    found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except Exception:  # noqa: BLE001 -- the parser raises ValueError, IndexError, ... on garbage: all mean "no reading"
        return None
    return found


def combine(values: list[tuple[dict[str, str], float]], *, shard_labels: frozenset[str] = frozenset(),
            across: str = "sum") -> float:
    """One number from a family's samples.

    Samples that differ only in `shard_labels` are shards of one scheduler
    reporting the same batch (SGLang's tp/pp ranks): take their max. What is
    left are independent schedulers (vLLM's `engine`, SGLang's `dp_rank`):
    `sum` them for request counts, `mean` them for a usage fraction.
    """
    groups: dict[tuple[tuple[str, str], ...], float] = {}
    for labels, value in values:
        key = tuple(sorted((k, v) for k, v in labels.items() if k not in shard_labels))
        groups[key] = max(groups.get(key, value), value)
    total = sum(groups.values())
    return total if across == "sum" else total / len(groups)
