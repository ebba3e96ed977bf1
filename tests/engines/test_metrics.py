"""Metrics adapters against real engines' /metrics pages.

The pages are byte-for-byte copies of the team's shared fixtures, kept in
`fixtures/metrics/` beside this file with the README that records where each
page came from, so a fresh clone runs these tests without anything beside
it. Expected numbers are the ones that README states for each page.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgwctl.contracts import LoadReading
from llmgwctl.engines import BUILTIN_DRIVERS, parse_load

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "metrics"


def page(name: str) -> str:
    path = FIXTURES / name
    if not path.is_file():
        pytest.fail(f"metrics fixture {path} is missing")
    return path.read_text()


@pytest.mark.parametrize("name, engine, expected", [
    ("vllm-v1.txt", "vllm", LoadReading(0, 0, 0.0011764705882353343, cache_tokens=850 * 16)),
    ("vllm-v1-idle.txt", "vllm", LoadReading(0, 0, 0.0, cache_tokens=39232)),
    ("vllm-legacy.txt", "vllm", LoadReading(0, 0, 0.0, cache_tokens=7281 * 16)),
    ("sglang.txt", "sglang", LoadReading(162, 2826, 0.28)),
    ("llamacpp.txt", "llamacpp", LoadReading(3, 0, None)),
    ("llamacpp-idle.txt", "llamacpp", LoadReading(0, 0, None)),
    ("llamacpp-idle-after-load.txt", "llamacpp", LoadReading(0, 0, None)),
    ("llamacpp-deferred.txt", "llamacpp", LoadReading(4, 2, None)),
])
def test_each_fixture_through_its_adapter(name, engine, expected):
    assert parse_load(engine, page(name)) == expected


@pytest.mark.parametrize("name", ["vllm-v1.txt", "sglang.txt", "llamacpp.txt", "vllm-legacy.txt"])
def test_a_page_from_another_engine_is_no_reading(name):
    own = {"vllm": "vllm", "sgla": "sglang", "llam": "llamacpp"}[name[:4]]
    for engine in ("vllm", "sglang", "llamacpp"):
        if engine != own:
            assert parse_load(engine, page(name)) is None, engine


def test_the_fake_engine_is_read_as_vllm():
    assert BUILTIN_DRIVERS["fake"].parse_metrics(page("vllm-v1.txt")) == LoadReading(0, 0, 0.0011764705882353343, cache_tokens=850 * 16)


def test_vllm_falls_back_to_the_deprecated_gpu_cache_gauge():
    without_kv = "\n".join(line for line in page("vllm-v1.txt").splitlines() if "vllm:kv_cache_usage_perc" not in line)
    assert parse_load("vllm", without_kv) == LoadReading(0, 0, 0.0011764705882353343, cache_tokens=850 * 16)


def _with_second_engine(text: str, values: dict[str, float]) -> str:
    """The real V1 page with a second data-parallel engine (engine="1") added after each load sample."""
    out = []
    for line in text.splitlines():
        out.append(line)
        m = re.match(r'^(vllm:\w+)\{engine="0",(.*)\} \S+$', line)
        if m and m.group(1) in values:
            out.append(f'{m.group(1)}{{engine="1",{m.group(2)}}} {values[m.group(1)]}')
    return "\n".join(out)


def test_vllm_sums_requests_and_averages_kv_across_data_parallel_engines():
    text = _with_second_engine(page("vllm-v1.txt"), {
        "vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 7.0, "vllm:kv_cache_usage_perc": 0.5,
        "vllm:gpu_cache_usage_perc": 0.5})
    reading = parse_load("vllm", text)
    assert (reading.running, reading.waiting) == (5.0, 7.0)
    assert reading.kv_cache == pytest.approx((0.0011764705882353343 + 0.5) / 2)


def test_vllm_v0_counts_swapped_requests_as_waiting():
    text = page("vllm-legacy.txt").replace('vllm:num_requests_swapped{model_name="facebook/opt-125m"} 0.0',
                                           'vllm:num_requests_swapped{model_name="facebook/opt-125m"} 3.0')
    assert parse_load("vllm", text).waiting == 3.0


def test_sglang_takes_one_value_per_tp_group_and_sums_dp_ranks():
    # Newer SGLang labels scheduler gauges by rank. Two dp ranks, each with
    # two tensor-parallel shards reporting their shared batch.
    lines = ["# TYPE sglang:num_running_reqs gauge", "# TYPE sglang:num_queue_reqs gauge",
             "# TYPE sglang:token_usage gauge"]
    for dp, (running, queued, usage) in enumerate([(10, 4, 0.2), (6, 0, 0.6)]):
        for tp in (0, 1):
            labels = f'engine_type="unified",model_name="m",dp_rank="{dp}",tp_rank="{tp}",pp_rank="0"'
            lines += [f"sglang:num_running_reqs{{{labels}}} {running}.0",
                      f"sglang:num_queue_reqs{{{labels}}} {queued}.0", f"sglang:token_usage{{{labels}}} {usage}"]
    reading = parse_load("sglang", "\n".join(lines) + "\n")
    assert (reading.running, reading.waiting) == (16.0, 4.0)
    assert reading.kv_cache == pytest.approx(0.4)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "fake", "some-catalog-engine"])
@pytest.mark.parametrize("text", ["", "garbage {{{ not prometheus", "\x00\xff binary", "# TYPE x gauge\nx{a=\"1\" 3\n",
                                  "up 1\nprocess_cpu_seconds_total 3.5\n",
                                  "vllm:num_requests_running{engine=\"0\"} NaN\n"])
def test_garbage_or_missing_families_is_no_reading_never_an_error(engine, text):
    assert parse_load(engine, text) is None


def test_running_without_waiting_is_no_reading():
    # Half a page (a truncated scrape) must not read as "nothing waiting".
    text = "\n".join(line for line in page("llamacpp.txt").splitlines() if "requests_deferred" not in line)
    assert parse_load("llamacpp", text) is None


def test_a_catalog_engine_is_read_with_whichever_adapter_fits():
    assert parse_load("my-vllm-fork", page("sglang.txt")) == LoadReading(162, 2826, 0.28)
    assert parse_load("my-vllm-fork", page("llamacpp-deferred.txt")) == LoadReading(4, 2, None)
