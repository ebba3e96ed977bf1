"""Profiles that span several nodes: `nodes: N` and how the model is split across them (`parallel`).

A profile with `nodes: 1` (the default) runs on one node, as every profile
always has, and nothing here applies to it. With `nodes: N > 1` a replica is
a *group* of N members, one per node, each on `gpus` GPUs of its own node
(`gpus` stays per node), launched with the engine's own multi-node support:
the head (rank 0) serves the API, the others join its rendezvous. This
module owns what those fields may be and the rules that span them and the
profile's other fields; placement and the engines' drivers read the
resolved values (`Profile.parallelism`), never the raw ones.

Imports nothing of ours but the model's types, and those only to name them.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import Profile

# How a model is split across its nodes:
# - tensor: every layer split over all nodes' GPUs (tensor-parallel size =
#   gpus x nodes). Needs a fast interconnect (InfiniBand, NVLink across
#   hosts): every layer waits on the network.
# - pipeline: the layers split into one stage per node, each stage tensor
#   parallel over its node's GPUs (pipeline-parallel size = nodes). What
#   vLLM's docs advise across nodes: only activations cross the network.
# - data: one full copy of the model per node (data-parallel size = nodes)
#   behind the head's one API server; for MoE models with expert parallel.
PARALLEL_MODES = ("tensor", "pipeline", "data")
# Pipeline across nodes, tensor within: vLLM's documented practice for a
# model that does not fit one node, and the one that asks least of the
# network between the nodes, so the one that works on the most fleets.
DEFAULT_PARALLEL = "pipeline"
# The most nodes one replica spans. A group is all or nothing: each member
# more is one more node that must be free at once and one more whose failure
# restarts the whole group; 64 nodes (512 GPUs of 8) is past the widest
# published deployment of one replica, and bounds placement's work per group.
MAX_NODES = 64
# Engines whose driver launches a replica across nodes with the engine's own
# multi-node support (vLLM's --nnodes/--node-rank/--master-addr, SGLang's
# --dist-init-addr/--nnodes/--node-rank). A catalog-defined engine's command
# template has no rank or head to fill in, and llama.cpp's RPC backend is not
# a rendezvous llmgw can drive.
MULTI_NODE_ENGINES = ("vllm", "sglang", "fake")
# How each of them may split a model. SGLang's data parallel across nodes
# goes with its DP attention for MoE models (--enable-dp-attention), a
# deployment choice llmgw cannot make for the operator; its tensor and
# pipeline splits are plain flags.
SPLITS = {"vllm": PARALLEL_MODES, "fake": PARALLEL_MODES, "sglang": ("tensor", "pipeline")}


def parallelism(profile: Profile) -> str | None:
    """How a replica of `profile` is split across its nodes, the default resolved; None on one node."""
    return None if profile.nodes == 1 else profile.parallel or DEFAULT_PARALLEL


def written(profile: Profile) -> dict[str, Any]:
    """The fields as `Profile.to_dict` writes them: only when not the default, so a one-node catalog keeps its version."""
    out: dict[str, Any] = {}
    if profile.nodes != 1:
        out["nodes"] = profile.nodes
    if profile.parallel is not None:
        out["parallel"] = profile.parallel
    return out


def check_multinode(profile: Profile) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """Why a profile's nodes and parallel cannot run as written (paths under the profile)."""
    nodes = profile.nodes
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        yield ("nodes",), f"expected an integer from 1 to {MAX_NODES}, got {nodes!r}"
        return
    if profile.parallel is not None and profile.parallel not in PARALLEL_MODES:
        yield ("parallel",), f"{profile.parallel!r} is not one of {', '.join(PARALLEL_MODES)}"
        return
    if nodes == 1:
        if profile.parallel is not None:
            yield ("parallel",), ("parallel says how a model is split across nodes, and this profile runs on "
                                  "one (nodes: 1); remove it, or give the profile nodes: 2 or more")
        return
    if profile.engine not in MULTI_NODE_ENGINES:
        yield ("nodes",), (f"engine {profile.engine!r} cannot run one replica across nodes "
                           f"(engines that can: {', '.join(MULTI_NODE_ENGINES)})")
    elif parallelism(profile) not in SPLITS[profile.engine]:
        yield ("parallel",), (f"engine {profile.engine!r} splits a model across nodes by "
                              f"{' or '.join(SPLITS[profile.engine])}, not {parallelism(profile)}")
    if profile.gpu_memory_mib is not None:
        # A member sharing a GPU with another replica would tie the group's
        # life to that replica's node neighbours; a group takes whole GPUs.
        yield ("gpu_memory",), ("a profile spanning nodes takes whole GPUs on each; "
                                "remove gpu_memory, or give the profile nodes: 1")
