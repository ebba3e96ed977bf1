"""Scenario 6: how catalogs really change -- a broken edit, a git checkout, an editor's save.

1. An invalid edit is written in place: rejected, the catalog in force stays.
2. `git checkout` of a commit that changes 30 files at once, in a clone
   whose files pass through a smudge filter taking ~20 ms each (as git-lfs
   or git-crypt do), so the checkout takes far longer than any debounce:
   exactly one swap, to the checked-out state -- none of the in-between
   states (an alias moves between files, weights change) is ever in force.
3. A vim-style save of the file holding the served model: scratch file,
   original renamed to a backup (for a moment the file is gone), new file
   written, backup removed: exactly one swap, and the model never leaves.

Throughout, a poller records every catalog version the controller has in force
and clients stream to the served model: only the states we meant are ever in
force, and no request fails.
"""
import os
import shutil
import subprocess

import pytest

from llmgwctl.catalog import load_dir
from tests.e2e.fleet import wait_until

from .load import Sampler, SteadyLoad, summary

FILES = 30
CORE = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: core
    aliases: [main]
    profiles: [{name: cpu, engine: fake, gpus: 0%s}]
"""


def small(k: int, revision: int) -> str:
    # Revision 2 moves alias `nick-k` from model m-k to m-(k+1) and changes every weight.
    alias = f"nick-{k - 1}" if revision == 2 else f"nick-{k}"
    aliases = f"[{alias}]" if revision == 1 or k > 0 else "[]"
    return (f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: m-{k:02d}\n    aliases: {aliases}\n"
            f"    replicas: {{min: 0, max: 1}}\n    idle_timeout: 1m\n"
            f"    profiles: [{{engine: fake, gpus: 0, weight: {revision}}}]\n")


class VersionsInForce(Sampler):
    """Every catalog version the controller has in force, read every 10 ms."""

    def __init__(self, control: str):
        super().__init__(lambda session: session.get(control + "/api/v1/catalog", timeout=5).json()["version"],
                         0.01, changes_only=True)


@pytest.fixture
def git(fleet):
    """git in the fleet's directory: the catalog directory is `catalogs/` of a clone, as operators keep it."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@localhost", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@localhost", GIT_CONFIG_NOSYSTEM="1", HOME=str(fleet.root))

    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=fleet.root, env=env, check=True, capture_output=True, text=True,
                              timeout=60).stdout
    run("init", "-q", "-b", "main")
    # A slow smudge filter, like git-lfs fetching or git-crypt decrypting each file.
    run("config", "filter.slow.smudge", "sleep 0.02; cat")
    run("config", "filter.slow.clean", "cat")
    (fleet.root / ".gitattributes").write_text("catalogs/*.yaml filter=slow\n")
    return run


def test_invalid_edit_checkout_and_editor_save_only_ever_put_meant_catalogs_in_force(fleet, git, figure):
    core = fleet.catalogs / "core.yaml"
    core.write_text(CORE % "")
    for k in range(FILES):
        (fleet.catalogs / f"m{k:02d}.yaml").write_text(small(k, 1))
    git("add", ".gitattributes", "catalogs")
    git("commit", "-q", "-m", "one")
    for k in range(FILES):
        (fleet.catalogs / f"m{k:02d}.yaml").write_text(small(k, 2))
    load_dir(fleet.catalogs)   # revision 2 is valid as a whole
    git("commit", "-q", "-m", "two", "--", "catalogs")
    git("checkout", "-q", "HEAD~1")
    meant = [load_dir(fleet.catalogs).version]

    fleet.start_controller()
    fleet.start_agent("n1", "none")
    (replica,) = wait_until(lambda: fleet.ready("core"), "core ready")

    def status():
        return fleet.status()["catalog"]

    with VersionsInForce(fleet.control) as versions, SteadyLoad(fleet.router, ["core", "main"], workers=2) as load:
        load.wait_for(10)
        start = status()

        # 1. A broken edit, saved in place.
        valid = core.read_text()
        core.write_text(valid.replace("engine: fake", "engine: vlm"))
        wait_until(lambda: status()["rejections"] > start["rejections"], "the broken edit rejected")
        broken = status()
        core.write_text(valid)   # put back: the same catalog, so no swap
        wait_until(lambda: status()["directory_valid"], "the directory valid again")
        load.wait_for(10)

        # 2. git checkout of 30 changed files.
        git("checkout", "-q", "main")
        meant.append(load_dir(fleet.catalogs).version)
        wait_until(lambda: status()["version"] == meant[-1], "the checkout in force")
        load.wait_for(10)
        checkout = status()

        # 3. vim's save: scratch file, original to a backup, new file, backup gone.
        swp, backup = fleet.catalogs / ".core.yaml.swp", fleet.catalogs / "core.yaml~"
        swp.write_text("b0VIM 9.0")
        os.rename(core, backup)
        core.write_text(CORE % ", weight: 3")
        backup.unlink()
        swp.unlink()
        meant.append(load_dir(fleet.catalogs).version)
        wait_until(lambda: status()["version"] == meant[-1], "the saved file in force")
        load.wait_for(10)
        saved = status()
    (after,) = fleet.ready("core")

    checkout_swaps = checkout["swaps"] - broken["swaps"]
    save_swaps = saved["swaps"] - checkout["swaps"]
    figure(f"broken edit rejected ({broken['swaps'] - start['swaps']} swaps); 30-file checkout: {checkout_swaps} swap, "
           f"{checkout['rejections'] - broken['rejections']} in-between states rejected; editor save: {save_swaps} swap; "
           f"versions in force {len(versions.seen)}, unmeant {len(set(versions.seen) - set(meant))}; {summary(load.outcomes)}")
    assert broken["swaps"] == start["swaps"] and broken["version"] == meant[0]
    assert "'vlm' is not one of" in broken["last_rejection"]["errors"][0]
    assert checkout_swaps == 1 and save_swaps == 1
    assert set(versions.seen) <= set(meant), versions.seen
    assert load.failures() == [], load.failures()[:5]
    assert after["id"] == replica["id"] and after["pid"] == replica["pid"]
