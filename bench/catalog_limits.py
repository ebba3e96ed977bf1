"""What the costliest catalogs within the loader's Limits cost to validate, shape by shape.

Each shape fills a directory up to the node budget (Limits.max_nodes, less a
margin) or the model cap (Limits.max_models), within every other limit -- file and directory bytes, models per file,
list lengths -- and is loaded cold in a child process of its own (so peak RSS
is that load's), on a worker thread while the main thread runs an asyncio
loop ticking every 5 ms: the loop's worst lag is what the router sharing the
process would have felt. The baseline in the same run is a realistic catalog
(the bundled shape: aliases, two profiles, args) of 1,000 models.

    python3 -m bench.catalog_limits [--shapes tiny,real,...] [--files N]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from llmgwctl.catalog.loader import DEFAULT_LIMITS, _measure, _models_per_file

from . import REPO

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\n"

# One item of each shape (a model, or what fills one model's list), by index.
SHAPES: dict[str, tuple[str, Callable[[int], str]]] = {
    "real": ("models", lambda i: (
        f"  - name: m{i}\n    aliases: [a{i}]\n    replicas: {{min: 0, max: 1}}\n    idle_timeout: 15m\n"
        f"    profiles:\n      - {{name: h100, engine: vllm, pool: h100, gpus: 1, priority: 10, args: [--max-model-len, 32768]}}\n"
        f"      - {{name: cpu, engine: llamacpp, gpus: 0, priority: 1}}\n")),
    "tiny": ("models", lambda i: f"  - {{name: m{i}, replicas: 0, profiles: [{{engine: fake}}]}}\n"),
    "aliases": ("models", lambda i: f"  - {{name: m{i}, replicas: 0, profiles: [{{engine: fake}}], aliases: ["
                + ", ".join(f"a{i}-{j}" for j in range(256)) + "]}\n"),
    "profiles": ("models", lambda i: f"  - {{name: m{i}, replicas: 0, profiles: ["
                 + ", ".join(f"{{name: p{j}, engine: fake}}" for j in range(32)) + "]}\n"),
    "args": ("models", lambda i: f"  - {{name: m{i}, replicas: 0, profiles: [{{engine: fake, args: ["
             + ", ".join(f"a{j}" for j in range(256)) + "]}]}\n"),
    "env": ("models", lambda i: f"  - {{name: m{i}, replicas: 0, profiles: [{{engine: fake, env: {{"
            + ", ".join(f"K{j}: v" for j in range(256)) + "}}]}\n"),
}


def nodes_of(text: str) -> int:
    return _measure(HEADER + "models:\n" + text, 1 << 30, 64)[0] - _measure(HEADER + "models: []\n", 1 << 30, 64)[0]


def write(directory: str, shape: str, budget: int) -> tuple[int, int, int]:
    """Fill `directory` with `shape` up to `budget` nodes; (files, bytes, items)."""
    _, item = SHAPES[shape]
    per_item = nodes_of(item(0))
    per_file_bytes = DEFAULT_LIMITS.max_file_bytes - 1024
    items = max(1, min((budget - 100) // per_item, DEFAULT_LIMITS.max_models))
    i = files = total = 0
    while i < items:
        parts, size, count = [HEADER, "models:\n"], 0, 0
        while i < items and count < _models_per_file():
            line = item(i)
            if size + len(line) > per_file_bytes:
                break
            parts.append(line)
            size += len(line)
            count += 1
            i += 1
        text = "".join(parts)
        with open(os.path.join(directory, f"f{files:03d}.yaml"), "w") as f:
            f.write(text)
        files += 1
        total += len(text)
        if total > DEFAULT_LIMITS.max_dir_bytes:
            raise SystemExit(f"{shape}: {total} bytes is past the directory cap; the shape cannot reach the node budget")
    return files, total, items


def child(directory: str) -> None:
    from llmgwctl.catalog import CatalogError, load_dir

    result: dict[str, Any] = {}

    def work() -> None:
        start = time.perf_counter()
        try:
            result["models"] = len(load_dir(directory))
        except CatalogError as exc:
            result["rejected"] = str(exc.problems[0])[:200]
        result["seconds"] = time.perf_counter() - start

    async def main() -> float:
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        worst = 0.0
        while thread.is_alive():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t - 0.005)
        return worst

    result["lag"] = asyncio.run(main())
    result["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="real1000," + ",".join(SHAPES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    print(f"limits: {DEFAULT_LIMITS.max_nodes} nodes, {DEFAULT_LIMITS.max_models} models, {DEFAULT_LIMITS.max_file_bytes >> 20} MiB a file, "
          f"{DEFAULT_LIMITS.max_dir_bytes >> 20} MiB the directory, {_models_per_file()} models a file")
    print(f"{'shape':10} {'files':>5} {'MB':>6} {'items':>7} {'load s':>7} {'x real1000':>10} {'loop lag ms':>11} "
          f"{'RSS MiB':>8}  result")
    base = None
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as d:
            if shape == "real1000":
                files, size, items = write(d, "real", 1000 * nodes_of(SHAPES["real"][1](0)) + 100)
            else:
                files, size, items = write(d, shape, DEFAULT_LIMITS.max_nodes - 1000)
            out = subprocess.run([sys.executable, "-m", __spec__.name, "--child", d], capture_output=True,
                                 text=True, check=True, cwd=REPO)
            r = json.loads(out.stdout.strip().splitlines()[-1])
        if base is None:
            base = r["seconds"]
        what = f"ok, {r['models']} models" if "models" in r else f"REJECTED: {r['rejected']}"
        print(f"{shape:10} {files:5d} {size / 1e6:6.2f} {items:7d} {r['seconds']:7.2f} {r['seconds'] / base:10.1f} "
              f"{r['lag'] * 1000:11.0f} {r['rss_mib']:8.0f}  {what}", flush=True)


if __name__ == "__main__":
    main()
