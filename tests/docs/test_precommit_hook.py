"""The pre-commit hook a catalog repository uses: what it runs passes a good catalog and stops a broken one.

pre-commit installs llmgw into its own environment and runs the hook's
`entry` plus `args` from the repository's root; here the same argv runs from
a directory laid out like such a repository (the console script is replaced
by `python -m llmgwctl`, which is the same `main`).
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
(HOOK,) = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())


def run_hook(root: Path) -> subprocess.CompletedProcess:
    entry = shlex.split(HOOK["entry"])
    assert entry[0] == "llmgwctl"
    argv = [sys.executable, "-m", "llmgwctl", *entry[1:], *HOOK["args"]]
    return subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=60)


def catalog_repo(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "catalogs", tmp_path / "catalogs")
    return tmp_path


def test_hook_definition():
    assert HOOK["id"] == "llmgwctl-catalog-validate"
    assert HOOK["language"] == "python"        # pre-commit pip-installs this repo: llmgw itself
    # The whole directory, every time: cross-file rules need every file.
    assert HOOK["pass_filenames"] is False and HOOK["args"] == ["catalogs/"]
    assert re.search(HOOK["files"], "catalogs/models.yaml") and re.search(HOOK["files"], "prod/a.yml")
    assert not re.search(HOOK["files"], "README.md")


def test_hook_passes_a_valid_catalog(tmp_path):
    out = run_hook(catalog_repo(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("valid: ")


def test_hook_stops_a_commit_that_reuses_a_name_in_another_file(tmp_path):
    root = catalog_repo(tmp_path)
    # Valid on its own; only the directory as a whole shows the clash.
    (root / "catalogs" / "team.yaml").write_text(
        "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"
        "  - name: smollm2\n    profiles: [{name: cpu, engine: fake, gpus: 0}]\n")
    out = run_hook(root)
    assert out.returncode == 1
    assert re.search(r"catalogs/\S+\.yaml:\d+:\d+: models\[\d\]\.name: name 'smollm2' is already", out.stdout + out.stderr), \
        out.stdout + out.stderr
