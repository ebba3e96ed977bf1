"""The catalog watcher follows what `--catalogs` resolves to, not the directory it first found there.

A release-style deploy switches a symlink: `current -> release-1` is replaced
by a renamed link `current -> release-2`, and release-1 is removed. The watch
on release-1 then sees nothing ever again: before, the switch itself was
taken, but no later edit nor `catalog apply` was (apply answered
`in_force: false`) while status said the watcher was `ok`. Here, against a
real `llmgwctl serve`: the switch, a later edit and an apply are all in force;
a directory that went away is shown in status (degraded, with why) while the
catalog in force stays, and once it is back it is followed again.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from llmgwctl.catalog import Live
from llmgwctl.catalog.watcher import CatalogWatcher
from tests.catalog.conftest import catalog_yaml
from tests.e2e.fleet import Fleet, wait_until
from tests.support import until

pytestmark = pytest.mark.timeout(240)

# A switch, an edit or a removal is in force (or shown) within seconds; this is room for a loaded machine.
WITHIN = 30.0


def catalog(*names: str) -> str:
    return "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n" + "".join(
        f"  - name: {n}\n    profiles: [{{engine: fake, gpus: 0}}]\n" for n in names)


def switch(link: Path, target: str) -> None:
    """Re-point `link` as a deploy does: a new link renamed over the old one."""
    tmp = link.with_name(link.name + ".next")
    os.symlink(target, tmp)
    os.replace(tmp, link)


def rename_into(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def model_names(fleet: Fleet) -> set[str]:
    return {m["name"] for m in fleet.status()["models"]}


def cli_status(control: str) -> str:
    result = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", control],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())


def test_a_release_switch_then_an_edit_and_an_apply_are_all_in_force(tmp_path):
    fleet = Fleet(tmp_path / "fleet")
    root = fleet.catalogs.parent
    fleet.catalogs.rmdir()
    (root / "release-1").mkdir()
    (root / "release-1" / "models.yaml").write_text(catalog("first"))
    os.symlink("release-1", fleet.catalogs)
    try:
        fleet.start_controller()
        wait_until(lambda: model_names(fleet) == {"first"}, "release-1 in force")

        (root / "release-2").mkdir()
        (root / "release-2" / "models.yaml").write_text(catalog("second"))
        switch(fleet.catalogs, "release-2")
        shutil.rmtree(root / "release-1")
        wait_until(lambda: model_names(fleet) == {"second"}, "the switch to release-2", timeout=WITHIN)
        wait_until(lambda: fleet.status()["catalog"]["followed"] == str((root / "release-2").resolve()),
                   "release-2 followed", timeout=WITHIN)

        # A later edit, through the link, as an operator on the machine makes it.
        rename_into(fleet.catalogs / "more.yaml", catalog("third"))
        wait_until(lambda: model_names(fleet) == {"second", "third"}, "the edit after the switch", timeout=WITHIN)

        # A `catalog apply`: its answer waits until the watcher has it in force.
        resp = requests.post(fleet.control + "/api/v1/catalog", timeout=60,
                             json={"filename": "applied.yaml", "content": catalog("fourth")})
        assert resp.status_code == 200, resp.text
        assert resp.json()["in_force"] is True, resp.json()
        assert model_names(fleet) == {"second", "third", "fourth"}
        status = fleet.status()
        assert status["catalog"]["watcher"] == "ok" and status["catalog"]["problem"] is None
        assert (root / "release-2" / "applied.yaml").exists()
    finally:
        fleet.close()


def test_a_removed_catalog_directory_is_shown_and_followed_again_when_it_is_back(tmp_path):
    fleet = Fleet(tmp_path / "fleet")
    root = fleet.catalogs.parent
    fleet.catalogs.rmdir()
    (root / "release-1").mkdir()
    (root / "release-1" / "models.yaml").write_text(catalog("first"))
    os.symlink("release-1", fleet.catalogs)
    try:
        fleet.start_controller()
        wait_until(lambda: model_names(fleet) == {"first"}, "release-1 in force")
        version = fleet.status()["catalog"]["version"]

        shutil.rmtree(root / "release-1")       # the link now points at nothing

        def shown():
            cat = fleet.status()["catalog"]
            return cat["watcher"] == "degraded" and "does not exist" in (cat["problem"] or "")
        wait_until(shown, "the removed directory shown in status", timeout=WITHIN)
        status = fleet.status()
        assert status["catalog"]["version"] == version and model_names(fleet) == {"first"}   # it stays in force
        row = {w["name"]: w for w in status["watchers"]}["catalog"]
        assert row["state"] == "degraded" and "does not exist" in row["problem"]
        assert requests.get(fleet.router + "/healthz", timeout=5).status_code == 200
        text = cli_status(fleet.control)
        assert "catalog watcher DEGRADED" in text and "does not exist" in text, text
        # An apply while there is no directory says why it is not in force.
        resp = requests.post(fleet.control + "/api/v1/catalog", timeout=60,
                             json={"filename": "x.yaml", "content": catalog("x")})
        assert resp.status_code >= 400 or resp.json().get("why_not_in_force"), resp.text

        # Back, as another release: followed again, and what it holds in force.
        (root / "release-2").mkdir()
        (root / "release-2" / "models.yaml").write_text(catalog("first", "again"))
        switch(fleet.catalogs, "release-2")
        wait_until(lambda: model_names(fleet) == {"first", "again"}, "the directory followed again", timeout=WITHIN)
        status = fleet.status()
        assert status["catalog"]["watcher"] == "ok" and status["catalog"]["problem"] is None
        rename_into(fleet.catalogs / "later.yaml", catalog("later"))
        wait_until(lambda: "later" in model_names(fleet), "an edit after it came back", timeout=WITHIN)
    finally:
        fleet.close()


async def _plain_directory_removed_and_made_again(tmp_path: Path) -> None:
    directory = tmp_path / "catalogs"
    directory.mkdir()
    (directory / "a.yaml").write_text(catalog_yaml("a"))
    live = Live()
    watcher = CatalogWatcher(directory, live, recheck=0.05)
    watcher.load_initial()
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        await until(lambda: watcher.followed is not None, "the directory followed", timeout=WITHIN)
        shutil.rmtree(directory)
        await until(lambda: watcher.status()["watcher"] == "degraded" and watcher.problem
                    and "does not exist" in watcher.problem, "the removal shown", timeout=WITHIN)
        assert live.current.resolve("a") is not None
        assert "the watcher cannot follow the directory" in watcher.why_not_in_force()
        directory.mkdir()
        (directory / "b.yaml").write_text(catalog_yaml("b"))
        await until(lambda: live.current.resolve("b") is not None, "the new directory loaded", timeout=WITHIN)
        assert watcher.status()["watcher"] == "ok"
        # The watch is on the new directory, not on the removed one's inode.
        tmp = directory / ".c.yaml.tmp"
        tmp.write_text(catalog_yaml("c"))
        os.replace(tmp, directory / "c.yaml")
        await until(lambda: live.current.resolve("c") is not None, "an edit in the new directory", timeout=WITHIN)
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, WITHIN)


def test_a_plain_directory_removed_and_made_again_is_followed_again(tmp_path):
    asyncio.run(_plain_directory_removed_and_made_again(tmp_path))
