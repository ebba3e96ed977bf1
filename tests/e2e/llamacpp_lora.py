"""A GGUF LoRA adapter for the bundled SmolLM2, as llama.cpp loads one: made in the test, cached beside the model.

llama-server's --lora takes what llama.cpp's convert_lora_to_gguf.py writes
from a PEFT directory: a GGUF whose `general.type` is `adapter`,
`adapter.type` `lora`, `adapter.lora.alpha` the scale numerator, the base's
`general.architecture`, and per adapted weight `NAME.lora_a` (rank x input,
PEFT's lora_A) and `NAME.lora_b` (output x rank, PEFT's lora_B), NAME the
base's own tensor name (`blk.N.attn_q.weight`). This writes one with the
`gguf` package's GGUFWriter, the shapes read from the base GGUF itself, and
seeded random A and B (a zero B, PEFT's default, would change nothing), so
the adapter's greedy answer differs from the base's and the same file comes
out on every machine. No torch, no peft, no conversion: a few MB of numpy.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .. import support

RANK = 8
# Targets: the attention's query and value projections, as PEFT's usual LoRA.
TARGETS = ("attn_q", "attn_v")
# Spread of the random factors: B @ A then moves each weight by ~0.1 x RANK x SCALE^2,
# a change the base's weights (spread ~0.05) do not hide, without making noise of every answer.
SCALE = 0.08


def need(ok: bool, reason: str) -> None:
    support.need(ok, reason, "LLMGW_REQUIRE_LLAMACPP", "the real llama.cpp engine")


def gguf_lora_adapter(base: Path, name: str, seed: int) -> Path:
    """The adapter file for the GGUF at `base`, cached under the llmgw cache by the base's name and the seed."""
    try:
        import gguf
        import numpy as np
    except ImportError:
        need(False, "making a GGUF LoRA adapter needs the gguf package: pip install gguf")
    from llmgwctl.engines.gguf import cache_root

    root = cache_root() / "lora-test"
    final = root / f"{base.stem[:40]}-{name}-r{RANK}-s{seed}.gguf"
    if final.is_file():
        return final
    reader = gguf.GGUFReader(str(base))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=root, prefix=f".{final.name}.")
    os.close(fd)
    writer = gguf.GGUFWriter(scratch, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(RANK))     # alpha / rank = 1: B @ A as drawn
    for tensor in reader.tensors:
        if not any(tensor.name.endswith(f".{t}.weight") for t in TARGETS):
            continue
        n_in, n_out = int(tensor.shape[0]), int(tensor.shape[1])    # GGUF's ne order: input first
        writer.add_tensor(tensor.name + ".lora_a", (rng.standard_normal((RANK, n_in)) * SCALE).astype(np.float32))
        writer.add_tensor(tensor.name + ".lora_b", (rng.standard_normal((n_out, RANK)) * SCALE).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(scratch, final)      # another run finishing first wrote the same bytes
    return final
