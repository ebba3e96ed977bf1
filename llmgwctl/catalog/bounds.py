"""Bounds on every number a catalog holds, and the checks that hold a model's numbers to them.

The catalog repository is trusted to describe the fleet, not to crash it:
placement and the reconciler do work per wanted replica, so an unbounded
count is unbounded work on the event loop. The bounds are repeated in
schemas/catalog.schema.json (editors show them); these are what holds when a
Catalog is built in code. `check_numbers(model)` is what `Catalog` runs on
each model; it imports the model's types only to name them.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import Autoscale, Model

# 1000 replicas of one model need at least 1000 GPUs (500 H100 boxes of 8 is a
# big fleet for one gateway), and a reconcile pass over 1000 wanted replicas
# takes milliseconds; past that the number is a typo, not a plan.
MAX_REPLICAS = 1000
# ...and the whole catalog wants at most this many: 1000 models scaling to 100
# each. It bounds a pass's work however many files a catalog is split into.
MAX_TOTAL_REPLICAS = 100_000
# The widest GPU count one replica spans: tensor parallelism across 8 nodes of 8.
MAX_GPUS = 64
# Weights are ratios between profiles; a million to one is already "never the
# other", and a bound keeps sums of weights far from float overflow.
MAX_WEIGHT = 1e6
# Priorities only order profiles; ±1e6 leaves room for any numbering scheme and
# stays exact in every int and float a metric or JSON reader uses.
PRIORITY_RANGE = (-1_000_000, 1_000_000)
# The most memory a profile may ask for per GPU: 1 TiB. The largest GPUs
# today hold under 300 GB, so this leaves room for generations to come and
# keeps sums of needs across a node's GPUs exact in every int.
MAX_GPU_MEMORY_MIB = 1 << 20
# An idle timeout past a year is "never" (write null), and a bound keeps clock
# arithmetic (now + timeout) exact in floats.
MAX_IDLE_TIMEOUT = 365 * 86400.0
# --- autoscale bounds ---
# A target is per replica: a million requests in flight or waiting on one
# replica is past any engine's batch (vLLM's max_num_seqs caps at thousands);
# KV-cache use is a fraction, so its target is (0, 1].
MAX_AUTOSCALE_TARGET = 1e6
# The stable window bounds how long load history is kept per model (one
# sample a pass); a day is past any diurnal lull worth holding replicas for.
MAX_SCALE_DOWN_WINDOW = 86400.0
# The fast path's factor: 1000x the target per replica is "always"; below 1 it
# would be below the target itself, where the normal path already steps.
FAST_FACTOR_RANGE = (1.0, 1000.0)
# The tolerance band: past half the target a band would let a fleet run at
# 1.5x its target (or half of it) without a step, which is no policy at all.
TOLERANCE_RANGE = (0.0, 0.5)
# --- end autoscale bounds ---


def _bounded(value: object, low: float, high: float, *, integer: bool = False) -> str | None:
    """Why `value` is not a number in [low, high] (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        return f"expected {'an integer' if integer else 'a number'} from {low:g} to {high:g}, got {type(value).__name__}"
    if not math.isfinite(value):
        return f"expected a finite number from {low:g} to {high:g}, got {value}"
    if not low <= value <= high:
        return f"expected a number from {low:g} to {high:g}, got {value:g}" if isinstance(value, float) else \
            f"expected a number from {low:g} to {high:g}, got {value}"
    return None


def check_numbers(model: Model) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """Every number of a model finite and in range, so no later pass can overflow or loop on it."""
    for key in ("min", "max"):
        why = _bounded(getattr(model.replicas, key), 0, MAX_REPLICAS, integer=True)
        if why:
            yield ("replicas", key) if model.replicas.min != model.replicas.max else ("replicas",), \
                why + f" (at most {MAX_REPLICAS} replicas of one model)"
            break
    if model.idle_timeout is not None:
        why = _bounded(model.idle_timeout, 0, MAX_IDLE_TIMEOUT)
        if why:
            yield ("idle_timeout",), why.replace(f"{MAX_IDLE_TIMEOUT:g}", "31536000 (365d)") + \
                " seconds; omit it or write null to never scale down"
    yield from check_autoscale(model.autoscale)
    why = _bounded(model.priority, *PRIORITY_RANGE, integer=True)
    if why:
        yield ("priority",), why
    for i, profile in enumerate(model.profiles):
        if profile.gpu_memory_mib is not None:
            why = _bounded(profile.gpu_memory_mib, 1, MAX_GPU_MEMORY_MIB, integer=True)
            if why:
                yield ("profiles", i, "gpu_memory"), why.replace(f"{MAX_GPU_MEMORY_MIB:g}", "1048576 (1TiB)") + " MiB"
            elif profile.gpus == 0:
                yield ("profiles", i, "gpu_memory"), ("a profile with gpus: 0 uses no GPU memory; "
                                                      "remove gpu_memory or give it gpus")
        for key, low, high, integer in (("gpus", 0, MAX_GPUS, True), ("priority", *PRIORITY_RANGE, True),
                                        ("weight", 0, MAX_WEIGHT, False)):
            value = getattr(profile, key)
            why = _bounded(value, low, high, integer=integer)
            if why is None and key == "weight" and value <= 0:
                why = f"expected a number greater than 0, got {value:g}"
            if why:
                yield ("profiles", i, key), why


def check_autoscale(policy: Autoscale) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """The autoscale block's numbers finite and bounded, and its metric one llmgw can read."""
    try:
        target = policy.policy().target
    except ValueError as exc:           # a metric llmgw cannot read: policy() names the ones it can
        yield ("autoscale", "metric"), str(exc)
        return
    high = 1.0 if policy.metric == "kv_cache" else MAX_AUTOSCALE_TARGET
    why = _bounded(target, 0, high)
    if why is None and target <= 0:
        why = f"expected a number greater than 0, got {target:g}"
    if why:
        yield ("autoscale", "target"), why + (" (KV-cache use is a fraction of the cache)" if high == 1.0 else "")
    why = _bounded(policy.scale_down_window, 0, MAX_SCALE_DOWN_WINDOW)
    if why:
        yield ("autoscale", "scale_down_window"), why + " seconds (at most 1d)"
    why = _bounded(policy.fast_factor, *FAST_FACTOR_RANGE)
    if why:
        yield ("autoscale", "fast_factor"), why
    why = _bounded(policy.max_step, 1, MAX_REPLICAS, integer=True)
    if why:
        yield ("autoscale", "max_step"), why
    why = _bounded(policy.tolerance, *TOLERANCE_RANGE)
    if why:
        yield ("autoscale", "tolerance"), why

