"""vLLM: `vllm serve`, and its load as its /metrics page reports it.

Load families: `vllm:num_requests_running`, `vllm:num_requests_waiting`, and
`vllm:kv_cache_usage_perc` (V1), falling back to `vllm:gpu_cache_usage_perc`
(V0, and V1 before ~0.11 printed both).

With data parallelism one vLLM server runs several engine cores, one `engine`
label each. Request counts are summed across them: the replica as a whole is
running and queueing that many. KV-cache usage is the *mean*: vLLM's front end
sends each new request to its least loaded engine, so the replica's headroom
is the pooled one; the max would call a replica full while its other engines
have room. The engines of one server are the same size, so the mean is the
share of the replica's KV cache in use.
"""
from __future__ import annotations

import importlib.util
import shutil

from .base import combine, replica_env, samples
from ..contracts import LoadReading, ReplicaSpec
from .spec import Launch

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
# V0 only: requests preempted to CPU memory. They wait to resume, so they count as waiting.
_SWAPPED = "vllm:num_requests_swapped"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"


class VllmDriver:
    name = "vllm"

    def launch(self, spec: ReplicaSpec, *, host: str, port: int) -> Launch:
        argv = ["vllm", "serve", spec.source, "--host", host, "--port", str(port),
                "--served-model-name", spec.model]
        if spec.gpus > 1:
            argv += ["--tensor-parallel-size", str(spec.gpus)]
        # The profile's args go last, so an operator's flag wins over ours.
        argv += spec.args
        return Launch(argv=tuple(argv), env=replica_env(spec), health_path="/health", metrics_path="/metrics")

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("vllm") is None:
            return False, "the vllm package is not installed for this Python; install it with: pip install vllm"
        if shutil.which("vllm") is None:
            return False, "the vllm package is installed but its `vllm` command is not on PATH; add its bin directory to PATH"
        return True, "vllm found"

    def parse_metrics(self, text: str) -> LoadReading | None:
        return parse_vllm(text)


def parse_vllm(text: str) -> LoadReading | None:
    found = samples(text, (_RUNNING, _WAITING, _SWAPPED, _KV, _KV_OLD))
    if not found or _RUNNING not in found or _WAITING not in found:
        return None
    waiting = combine(found[_WAITING]) + (combine(found[_SWAPPED]) if _SWAPPED in found else 0.0)
    kv_samples = found.get(_KV) or found.get(_KV_OLD)
    kv = combine(kv_samples, across="mean") if kv_samples else None
    return LoadReading(running=combine(found[_RUNNING]), waiting=waiting, kv_cache=kv)
