"""SGLang's members of a replica spanning nodes: its own multi-node flags, from the slot the controller chose.

SGLang has no build that runs on this machine's processor (AVX2 only), so
these pin the command lines against SGLang's documented multi-node launch
(`--dist-init-addr HEAD:PORT --nnodes N --node-rank R`, `--tp-size` over
every GPU for tensor parallel, `--pp-size` stages for pipeline).
"""
from __future__ import annotations

import sys

import pytest

from llmgwctl.contracts import GroupSlot, ReplicaSpec
from llmgwctl.engines.sglang import SglangDriver


def member(rank: int, parallel: str, gpus: int = 8, head: str = "10.0.0.5") -> ReplicaSpec:
    slot = GroupSlot(group="big-1", rank=rank, size=2, parallel=parallel, head_host=head, port=29611)
    return ReplicaSpec(id=slot.member_id(rank), model="deepseek-r1", profile="p", engine="sglang",
                       source="deepseek-ai/DeepSeek-R1", gpus=gpus, gpu_indices=tuple(range(gpus)),
                       args=("--trust-remote-code",), group=slot)


def argv(spec: ReplicaSpec) -> tuple[str, ...]:
    return SglangDriver().launch(spec, host="0.0.0.0", port=20001).argv


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_spans_every_gpu_of_every_node(rank):
    got = argv(member(rank, "tensor"))
    assert got == (sys.executable, "-m", "sglang.launch_server", "--model-path", "deepseek-ai/DeepSeek-R1",
                   "--host", "0.0.0.0", "--port", "20001", "--served-model-name", "deepseek-r1",
                   "--tp-size", "16", "--dist-init-addr", "10.0.0.5:29611", "--nnodes", "2",
                   "--node-rank", str(rank), "--enable-metrics", "--trust-remote-code")


def test_pipeline_parallel_is_a_stage_per_node_tensor_parallel_within():
    got = argv(member(1, "pipeline"))
    at = got.index("--tp-size")
    assert got[at:at + 10] == ("--tp-size", "8", "--pp-size", "2", "--dist-init-addr", "10.0.0.5:29611",
                               "--nnodes", "2", "--node-rank", "1")


def test_an_ipv6_head_is_bracketed():
    assert "[fd00::5]:29611" in argv(member(0, "tensor", head="fd00::5"))


def test_a_one_node_replica_is_launched_as_before():
    spec = ReplicaSpec(id="r", model="m", profile="p", engine="sglang", source="m", gpus=2, gpu_indices=(0, 1))
    got = argv(spec)
    assert "--nnodes" not in got and got[got.index("--tp-size") + 1] == "2"
