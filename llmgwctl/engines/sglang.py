"""SGLang: `python -m sglang.launch_server`, and its load from /metrics.

SGLang prints metrics only with `--enable-metrics`, so the driver always adds
it: without it the router would have no load to weigh this replica by.

Load families: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage` (the share of KV-cache tokens in use). Older releases
label them with `model_name` only; newer ones add `tp_rank`, `pp_rank`,
`moe_ep_rank` and `dp_rank`. Samples that differ only in tp/pp/ep rank are
shards of one scheduler's batch, so we take their max rather than count one
batch several times; separate `dp_rank`s are separate schedulers, summed for
request counts and averaged for token usage (see vllm.py for why the mean).
"""
from __future__ import annotations

import importlib.util
import sys

from ..contracts import GroupSlot, LoadReading, ReplicaSpec
from .base import combine, replica_env, samples
from .spec import Launch

_RUNNING = "sglang:num_running_reqs"
_WAITING = "sglang:num_queue_reqs"
_KV = "sglang:token_usage"
_SHARDS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})


class SglangDriver:
    name = "sglang"

    def launch(self, spec: ReplicaSpec, *, host: str, port: int) -> Launch:
        # sys.executable: the Python `available()` found sglang in, not whatever `python` is on PATH.
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.source, "--host", host,
                "--port", str(port), "--served-model-name", spec.model]
        slot = spec.group
        if slot is not None:
            argv += group_args(slot, spec.gpus)
        elif spec.gpus > 1:
            argv += ["--tp-size", str(spec.gpus)]
        argv += ["--enable-metrics"]
        argv += spec.args   # last, so the operator's flags win
        return Launch(argv=tuple(argv), env=replica_env(spec), health_path="/health", metrics_path="/metrics")

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("sglang") is None:
            return False, ("the sglang package is not installed for this Python "
                           f"({sys.executable}); install it with: pip install 'sglang[all]'")
        return True, "sglang found"

    def parse_metrics(self, text: str) -> LoadReading | None:
        return parse_sglang(text)


def group_args(slot: GroupSlot, gpus: int) -> list[str]:
    """SGLang's own multi-node launch for one member (`--dist-init-addr`, `--nnodes`, `--node-rank`).

    Every member runs the same command but its rank; rank 0 serves the API,
    the others run their share of the model and serve nothing (SGLang starts
    no HTTP server on a node of rank 1 or more). Tensor parallel spans every
    GPU of every node; pipeline parallel puts one stage on each node, tensor
    parallel within it. The catalog refuses data parallel for SGLang
    (catalog/multinode.SPLITS).
    """
    if slot.parallel == "tensor":
        split = ["--tp-size", str(gpus * slot.size)]
    else:
        split = ["--tp-size", str(max(1, gpus)), "--pp-size", str(slot.size)]
    return [*split, "--dist-init-addr", f"{_host(slot.head_host)}:{slot.port}",
            "--nnodes", str(slot.size), "--node-rank", str(slot.rank)]


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host     # an IPv6 address, bracketed


def parse_sglang(text: str) -> LoadReading | None:
    found = samples(text, (_RUNNING, _WAITING, _KV))
    if not found or _RUNNING not in found or _WAITING not in found:
        return None
    kv = combine(found[_KV], shard_labels=_SHARDS, across="mean") if _KV in found else None
    return LoadReading(running=combine(found[_RUNNING], shard_labels=_SHARDS),
                       waiting=combine(found[_WAITING], shard_labels=_SHARDS), kv_cache=kv)
