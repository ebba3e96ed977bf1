"""The catalog watcher cannot die silently (issue 13 item 2).

At b616774 any exception but CatalogError/OSError ended `run()`, and its
`finally` set the caller's stop event, which stopped the reconciler too;
status still said the directory was valid and no later edit was loaded.
"""
import asyncio
import os
import time

from llmgwctl.catalog import Live
from llmgwctl.catalog.watcher import CatalogWatcher
from tests.catalog.conftest import catalog_yaml

DEADLINE = 20.0


async def until(predicate, what: str):
    end = time.monotonic() + DEADLINE
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def rename_into(path, text):
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.rename(tmp, path)


async def scenario(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text(catalog_yaml("a"))
    live = Live()
    watcher = CatalogWatcher(tmp_path, live)
    watcher.load_initial()
    # A subscriber with a bug: it raises on one swap. That exception surfaces
    # in the watcher's reload, where nothing expected it.
    def flaky(old, new):
        if new.resolve("boom"):
            raise RuntimeError("a subscriber broke")
    live.subscribe(flaky)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await asyncio.sleep(0.1)
    try:
        rename_into(a, catalog_yaml("a", "boom"))
        await until(lambda: watcher.failures == 1, "the failure counted")
        status = watcher.status()
        assert status["watcher"] == "degraded" and "a subscriber broke" in status["last_failure"]["error"]
        assert not stop.is_set() and not task.done()      # the caller's loops go on
        rename_into(a, catalog_yaml("a", "c"))
        await until(lambda: live.current.resolve("c") is not None, "the next edit in force")
        assert watcher.status()["watcher"] == "ok"
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE)


def test_an_unexpected_error_in_one_reload_is_counted_shown_and_survived(tmp_path):
    asyncio.run(scenario(tmp_path))
