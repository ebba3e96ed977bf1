"""How fast an edit to a catalog file is in force, next to the floor no watcher can beat.

Measured in one run, on one directory:
  raw event   rename of a catalog file -> watchfiles yields the event (step=10 ms)
  in force    rename of a catalog file -> CatalogWatcher has validated the whole
              directory and swapped Live (what an operator waits for)
  load        load + validate of a 1,000-model catalog, cold and after one file changed

    python3 -m bench.catalog_swap [--edits 200] [--models 1000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import watchfiles

from llmgwctl.catalog import Catalog, Live, load_dir
from llmgwctl.catalog.loader import FileCache
from llmgwctl.catalog.watcher import STEP_MS, CatalogWatcher

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"


def model_yaml(name: str, alias: str) -> str:
    return (f"  - name: {name}\n    aliases: [{alias}]\n    replicas: {{min: 1, max: 4}}\n    idle_timeout: 15m\n"
            f"    profiles:\n      - {{name: h100, engine: vllm, pool: h100, gpus: 1, priority: 10, args: [--max-model-len, 32768]}}\n"
            f"      - {{name: cpu, engine: llamacpp, gpus: 0, priority: 1}}\n")


def rename_into(directory: Path, name: str, text: str) -> float:
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    start = time.perf_counter()
    os.rename(tmp, directory / name)
    return start


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def raw_events(directory: Path, edits: int) -> list[float]:
    latencies: list[float] = []
    stop = asyncio.Event()
    got = asyncio.Event()
    stamp: list[float] = []

    async def watch() -> None:
        async for _ in watchfiles.awatch(directory, step=STEP_MS, stop_event=stop, debounce=1000):
            stamp.append(time.perf_counter())
            got.set()

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.2)
    for i in range(edits):
        got.clear()
        stamp.clear()
        start = rename_into(directory, "edit.yaml", HEADER + model_yaml("edit", f"raw{i}"))
        await asyncio.wait_for(got.wait(), 5)
        latencies.append(stamp[0] - start)
        await asyncio.sleep(0.02)
    stop.set()
    await task
    return latencies


async def in_force(directory: Path, edits: int) -> list[float]:
    live = Live()
    watcher = CatalogWatcher(directory, live)
    watcher.load_initial()
    swapped = asyncio.Event()
    stamp: list[float] = []
    def swap(old: Catalog, new: Catalog) -> None:
        stamp.append(time.perf_counter())
        swapped.set()

    live.subscribe(swap)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await asyncio.sleep(0.2)
    latencies: list[float] = []
    for i in range(edits):
        swapped.clear()
        stamp.clear()
        start = rename_into(directory, "edit.yaml", HEADER + model_yaml("edit", f"live{i}"))
        await asyncio.wait_for(swapped.wait(), 5)
        latencies.append(stamp[0] - start)
        assert live.current.resolve(f"live{i}") is not None
        await asyncio.sleep(0.02)
    stop.set()
    await task
    return latencies


def big_catalog(directory: Path, models: int, files: int = 10) -> None:
    per = models // files
    for f in range(files):
        body = "".join(model_yaml(f"model-{f}-{i}", f"alias-{f}-{i}") for i in range(per))
        (directory / f"part{f:02}.yaml").write_text(HEADER + body)


def timed(fn: Callable[[], object], repeat: int) -> float:
    best = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best.append(time.perf_counter() - start)
    return statistics.median(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edits", type=int, default=200)
    parser.add_argument("--models", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "base.yaml").write_text(HEADER + model_yaml("base", "b"))
        raw = asyncio.run(raw_events(directory, args.edits))
        live = asyncio.run(in_force(directory, args.edits))

    def ms(s: float) -> str:
        return f"{s * 1000:7.1f}"

    print(f"edit -> in force, {args.edits} edits each (write temp file, rename over the catalog file)")
    print(f"{'':28}{'p50 ms':>8}{'p99 ms':>8}")
    print(f"{'raw inotify via watchfiles':28}{ms(pct(raw, .5))} {ms(pct(raw, .99))}")
    print(f"{'llmgw catalog in force':28}{ms(pct(live, .5))} {ms(pct(live, .99))}")
    print(f"{'ratio in force / raw':28}{pct(live, .5) / pct(raw, .5):8.2f}{pct(live, .99) / pct(raw, .99):8.2f}")
    print(f"{'added by validate + swap':28}{ms(pct(live, .5) - pct(raw, .5))}")
    print("target: p50 <= 40 ms, p99 <= 60 ms (peers: ~2 s polling, or a restart)")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        big_catalog(directory, args.models)
        cold = timed(lambda: load_dir(directory), 5)
        per = args.models // 10
        cache = FileCache()
        load_dir(directory, cache=cache)
        n = [0]

        def one_file_changed() -> None:
            n[0] += 1
            # The same 100 models, one alias changed: what a typical edit does.
            body = "".join(model_yaml(f"model-0-{i}", f"alias-0-{i}" if i else f"edited-{n[0]}") for i in range(per))
            (directory / "part00.yaml").write_text(HEADER + body)
            load_dir(directory, cache=cache)
        warm = timed(one_file_changed, 5)
    print(f"\nload + validate {args.models} models in 10 files: {cold * 1000:.0f} ms cold, "
          f"{warm * 1000:.0f} ms after one file changed (cached parse of the other 9), ratio {warm / cold:.2f}")


if __name__ == "__main__":
    main()
