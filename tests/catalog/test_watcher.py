"""The watcher against a real directory and real inotify events: every valid state, never an invalid one."""
import asyncio
import os

import pytest

from llmgwctl.catalog import CatalogError, Live
from llmgwctl.catalog.watcher import CatalogWatcher

from ..support import DEADLINE, until
from .conftest import catalog_yaml


def names(live):
    return set(live.current.names())


def write_atomically(path, text):
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.rename(tmp, path)


async def scenario(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(catalog_yaml("a:x"))
    live = Live()
    watcher = CatalogWatcher(tmp_path, live)
    watcher.load_initial()
    swapped = []
    live.subscribe(lambda old, new: swapped.append(frozenset(new.names())))
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        # A new model in a new file. Written again until the watcher sees it:
        # its inotify watch is armed at some moment after run() starts, and an
        # edit before that moment is not an event. The same content again is
        # no second swap, so the list of swaps below still holds.
        await until(lambda: names(live) == {"a", "x", "b"}, "model b from a new file",
                    nudge=lambda: write_atomically(b, catalog_yaml("b")), every=0.05)

        # An alias edited, as an editor saves: write a temp file, rename over.
        write_atomically(a, catalog_yaml("a:y"))
        await until(lambda: names(live) == {"a", "y", "b"}, "alias edit")

        # A file deleted.
        b.unlink()
        await until(lambda: names(live) == {"a", "y"}, "file deletion")

        # Invalid YAML: rejected, the last good catalog stays, the rejection is kept.
        before = live.current
        rejections = watcher.rejections
        a.write_text("apiVersion: llmgw/v1\nkind: [\n")
        await until(lambda: watcher.rejections > rejections, "rejection of invalid YAML")
        assert live.current is before
        assert watcher.last_rejection and "a.yaml:3:1: invalid YAML" in str(watcher.last_rejection.problems[0])
        assert watcher.status()["directory_valid"] is False

        # Half a file, then the rest: the half is rejected, the whole is taken.
        full = catalog_yaml("a:z", "c")
        rejections = watcher.rejections
        with open(a, "w") as f:
            f.write(full[: full.index("profiles") + 12])
            f.flush()
            await until(lambda: watcher.rejections > rejections, "rejection of half a file")
            assert live.current is before
            f.write(full[full.index("profiles") + 12:])
        await until(lambda: names(live) == {"a", "z", "c"}, "the completed file")
        assert watcher.status()["directory_valid"] is True

        # Same content, reformatted: no swap.
        count = watcher.swaps
        a.write_text("# just a comment\n" + full)
        c = tmp_path / "c.yaml"
        c.write_text(catalog_yaml("late"))  # a later, real change to know the first was processed
        await until(lambda: "late" in names(live), "the change after a no-op edit")
        assert watcher.swaps == count + 1

        # A checkout of 30 files at once: one swap to the final state.
        staging = tmp_path / "staging"
        staging.mkdir()
        for i in range(30):
            (staging / f"m{i}.yaml").write_text(catalog_yaml(f"m{i}"))
        count = watcher.swaps
        for i in range(30):
            os.rename(staging / f"m{i}.yaml", tmp_path / f"m{i}.yaml")
        await until(lambda: "m29" in names(live) and "m0" in names(live), "the checkout")
        # A later change, seen, means every event of the checkout was handled:
        # a stray second swap of it would have shown by now.
        (tmp_path / "d.yaml").write_text(catalog_yaml("after"))
        await until(lambda: "after" in names(live), "the change after the checkout")
        assert watcher.swaps == count + 2
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE)
    # Every catalog that was ever in force is one of the valid states written.
    valid = [{"a", "x", "b"}, {"a", "y", "b"}, {"a", "y"}, {"a", "z", "c"}, {"a", "z", "c", "late"},
             {"a", "z", "c", "late"} | {f"m{i}" for i in range(30)},
             {"a", "z", "c", "late", "after"} | {f"m{i}" for i in range(30)}]
    assert [set(s) for s in swapped] == valid


def test_watcher_follows_every_valid_state_and_never_an_invalid_one(tmp_path):
    asyncio.run(scenario(tmp_path))


def test_invalid_directory_at_start_is_the_callers_decision(tmp_path):
    (tmp_path / "a.yaml").write_text("kind: [")
    watcher = CatalogWatcher(tmp_path, Live())
    with pytest.raises(CatalogError):
        watcher.load_initial()


def test_reload_once_without_watching(tmp_path):
    (tmp_path / "a.yaml").write_text(catalog_yaml("a"))
    live = Live()
    watcher = CatalogWatcher(tmp_path, live, wall_clock=lambda: 1234.0)
    outcome = watcher.reload()
    assert outcome.swapped and outcome.diff.added == ("a",)
    assert watcher.reload().swapped is False  # same content: no second swap
    (tmp_path / "a.yaml").write_text(catalog_yaml("a", "a"))
    outcome = watcher.reload()
    assert outcome.rejection and outcome.rejection.at == 1234.0
    assert outcome.catalog is live.current and set(live.current.names()) == {"a"}
    os.rename(tmp_path, tmp_path.with_name("gone"))
    assert watcher.reload().rejection.problems[0].message == "no such file or directory"
    assert set(live.current.names()) == {"a"}  # a vanished directory is not an empty catalog


def test_an_edit_between_the_start_load_and_the_watch_is_carried_out(tmp_path):
    # serve loads the directory, then starts watching it: an edit in between
    # is no inotify event for a watch not yet made, and it waited for the
    # next edit to be seen (CI: a cycle written right after start never rejected).
    a = tmp_path / "a.yaml"
    a.write_text(catalog_yaml("a:x"))
    live = Live()
    watcher = CatalogWatcher(tmp_path, live)
    watcher.load_initial()
    write_atomically(a, catalog_yaml("a:y"))

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.run(stop))
        try:
            await until(lambda: names(live) == {"a", "y"}, "the edit made before the watch")
        finally:
            stop.set()
            await asyncio.wait_for(task, DEADLINE)

    asyncio.run(main())
