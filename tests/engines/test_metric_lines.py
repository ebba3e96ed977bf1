"""Adapters read only their families' lines (engines.base.sample_lines), and read every real page as before.

A page is the engine's to fill: a million series of families no adapter
uses must cost a scan for a few names, not a million parsed lines. What the
adapters get must not change for any real page, so each fixture is read both
ways -- the whole page through prometheus_client's parser, and only the
wanted lines -- and the samples compared.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgwctl.engines import llamacpp, parse_load, sglang, vllm
from llmgwctl.engines.base import MAX_SAMPLE_LINES, sample_lines, samples

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "metrics"
NAMES = {
    "vllm": (vllm._RUNNING, vllm._WAITING, vllm._SWAPPED, vllm._KV, vllm._KV_OLD, vllm._CACHE_INFO),
    "sglang": (sglang._RUNNING, sglang._WAITING, sglang._KV),
    "llamacpp": (llamacpp._RUNNING, llamacpp._WAITING),
}


def whole_page(text: str, names) -> dict:
    """What `samples` returned when it parsed the whole page."""
    found: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and not math.isnan(sample.value):
                found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.txt")))
@pytest.mark.parametrize("engine", sorted(NAMES))
def test_every_fixture_reads_the_same_through_its_lines(fixture, engine):
    text = (FIXTURES / fixture).read_text()
    assert samples(text, NAMES[engine]) == whole_page(text, set(NAMES[engine]))


def test_other_families_are_skipped_however_many():
    real = (FIXTURES / "vllm-v1.txt").read_text()
    noise = "".join(f'vllm:num_requests_running_by_lora{{i="{i}"}} 1.0\n' for i in range(200_000))
    text = noise + real + "\n# HELP vllm:num_requests_running x\n" + noise
    assert parse_load("vllm", text) == parse_load("vllm", real)


def test_a_name_is_matched_whole_not_as_a_prefix():
    lines = sample_lines("a_total 1\na 2\na{x=\"1\"} 3\n# TYPE a gauge\nab 4\na\t5", ["a"])
    assert lines == ["a 2", 'a{x="1"} 3', "a\t5"]


def test_past_the_limit_of_wanted_lines_is_no_reading():
    text = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1.0\nvllm:num_requests_waiting{{engine="{i}"}} 0.0\n'
                   for i in range(MAX_SAMPLE_LINES))
    assert parse_load("vllm", text) is None
    small = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1.0\nvllm:num_requests_waiting{{engine="{i}"}} 0.0\n'
                    for i in range(8))
    assert parse_load("vllm", small).running == 8
