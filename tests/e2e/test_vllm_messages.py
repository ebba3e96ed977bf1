"""Real vLLM: Anthropic's Messages API through `llmgwctl serve`, with the official `anthropic` SDK.

The bundled SmolLM2 on vLLM's CPU backend (its own /v1/messages, which
turns the request into a chat one and the answer back into Anthropic's
shapes), asked by an alias: the engine is sent the canonical name (vLLM
404s any name it does not serve), the answer comes back under the alias,
its usage counted by vLLM's tokenizer and metered by the router as chat's
is. One engine, `--max-num-seqs 1`, its threads pinned to one core (see
vllm.py).

Skipped when vLLM, the model file or the conversion's modules are missing,
unless LLMGW_REQUIRE_VLLM=1 (.ci/run sets it): then their absence fails.
"""
from __future__ import annotations

import anthropic
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .vllm import MODEL, bundled_model, served_vllm

# As test_vllm.py: the first start converts the GGUF and vLLM loads on one core.
READY_TIMEOUT = 600.0
REQUEST_TIMEOUT = 120.0
pytestmark = pytest.mark.timeout(1200)
SERVE_ARGS = ("--settle", "2", "--poll-interval", "0.5")
ALIAS = "claude-local"


def aliased_catalog() -> str:
    doc, model, profile = bundled_model()
    model["aliases"] = [ALIAS]
    profile["args"] = [*profile["args"], "--max-num-seqs", "1"]
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    with served_vllm(tmp_path_factory.mktemp("vllm-messages"), {"vllm.yaml": aliased_catalog()}, request,
                     *SERVE_ARGS, ready_timeout=READY_TIMEOUT, what="vllm messages e2e") as fleet:
        yield fleet


def router_tokens(fleet) -> dict[str, float]:
    page = requests.get(fleet.router + "/metrics", timeout=10).text
    return {s.labels["direction"]: s.value for family in text_string_to_metric_families(page)
            for s in family.samples if s.name == "llmgw_router_tokens_total" and s.labels.get("model") == MODEL}


def test_messages_create_on_vllm_answers_with_text_and_usage_under_the_alias(served):
    client = anthropic.Anthropic(base_url=served.router, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)
    before = router_tokens(served)
    raw = client.messages.with_raw_response.create(
        model=ALIAS, max_tokens=12, system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "Say hello in one short sentence."}])
    msg = raw.parse()
    assert msg.model == ALIAS and msg.role == "assistant"
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= msg.usage.output_tokens <= 12        # counted by vLLM's tokenizer
    assert msg.usage.input_tokens > 10               # SmolLM2's chat template wrapped system and message
    assert raw.headers["x-llmgw-replica"]
    after = router_tokens(served)
    assert after.get("in", 0) - before.get("in", 0) == msg.usage.input_tokens
    assert after.get("out", 0) - before.get("out", 0) == msg.usage.output_tokens
    served.say(f"vllm messages e2e: {msg.usage.input_tokens} in, {msg.usage.output_tokens} out: "
               f"{msg.content[0].text.strip()[:80]!r}")


def test_a_messages_stream_on_vllm_has_the_sdks_events_under_the_alias(served):
    client = anthropic.Anthropic(base_url=served.router, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)
    with client.messages.stream(model=ALIAS, max_tokens=12,
                                messages=[{"role": "user", "content": "Name a colour."}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert pieces and "".join(pieces).strip()
    assert final.model == ALIAS and final.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= final.usage.output_tokens <= 12
    # The text the stream carried is the final message's, with nothing lost at the router.
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    # vLLM's own /v1/messages/count_tokens, reached through the router by the alias too.
    counted = client.messages.count_tokens(model=ALIAS, messages=[{"role": "user", "content": "Name a colour."}])
    assert counted.input_tokens > 3
    served.say(f"vllm messages e2e: streamed {len(pieces)} text deltas, {final.usage.output_tokens} tokens; "
               f"count_tokens {counted.input_tokens}")
