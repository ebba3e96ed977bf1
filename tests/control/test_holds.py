"""The holds file: cordons kept across a controller restart, and a start refused when it cannot be read."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgwctl.control import holds

from ..procs import free_port

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: m
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def test_no_file_is_no_hold_and_what_is_saved_is_read_back(tmp_path):
    path = holds.path_in(tmp_path)
    assert holds.load(path) == {}
    holds.save(path, {"gpu-7": True, "gpu-9": False})
    assert holds.load(path) == {"gpu-7": True, "gpu-9": False}
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    holds.save(path, {})
    assert holds.load(path) == {}


@pytest.mark.parametrize("content,why", [
    ("{not json", "not JSON"),
    ('{"kind": "NodeHolds", "nodes": {"n1": {"drain": "yes"}}}', "not a NodeHolds document"),
    ('[1, 2]', "not a NodeHolds document"),
])
def test_a_file_that_is_not_holds_is_refused_naming_it(tmp_path, content, why):
    path = holds.path_in(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(holds.HoldsFileError, match=why) as err:
        holds.load(path)
    assert str(path) in str(err.value) and "uncordons every node" in str(err.value)


def test_a_fifo_in_its_place_is_refused_without_blocking(tmp_path):
    path = holds.path_in(tmp_path)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with pytest.raises(holds.HoldsFileError):
        holds.load(path)


def test_serve_refuses_to_start_on_a_holds_file_it_cannot_read(tmp_path: Path):
    (tmp_path / "catalogs").mkdir()
    (tmp_path / "catalogs" / "m.yaml").write_text(CATALOG)
    path = holds.path_in(tmp_path / "state")
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "serve", "--no-local-agent", "--catalogs",
                          str(tmp_path / "catalogs"), "--state-dir", str(tmp_path / "state"),
                          "--listen", f"127.0.0.1:{free_port()}", "--control", f"127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert str(path) in out.stderr and "not JSON" in out.stderr
