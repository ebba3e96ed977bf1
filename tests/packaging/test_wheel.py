"""A built wheel is what a user gets: it installs, serves, and carries its schemas, man pages and licence.

The wheel is built without build isolation (no network, and the setuptools CI
really has), installed into a fresh virtualenv, and run from there with no
source tree on the path: from a temporary directory, without PYTHONPATH, so an
editable install or a checkout beside the test cannot stand in for it.
"""
import configparser
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import requests

from ..e2e.fleet import Fleet
from ..support import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy without build/ and *.egg-info: setuptools reuses
    # build/lib, so a module that an earlier build saw would still ride along
    # in the wheel after its package stopped being found.
    src = tmp_path_factory.mktemp("src") / "llmgw"
    shutil.copytree(REPO, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".*cache", ".hypothesis"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                   check=True, timeout=300, capture_output=True)
    (path,) = out.glob("llmgw-*.whl")
    return path


def test_wheel_carries_schema_and_man_pages(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "llmgwctl/_data/schemas/catalog.schema.json" in names
    for schema in os.listdir(REPO / "schemas" / "api"):
        assert f"llmgwctl/_data/schemas/api/{schema}" in names
    for page in os.listdir(REPO / "man"):
        assert f"llmgwctl/_data/man/{page}" in names
        section = page.rsplit(".", 1)[1]
        assert any(n.endswith(f".data/data/share/man/man{section}/{page}") for n in names), page
    assert any(n.endswith(".data/data/share/llmgw/schemas/catalog.schema.json") for n in names)
    # The web console the control API serves: every file of it (its vendored charting library
    # too), or the page breaks.
    console = REPO / "llmgwctl" / "control" / "console"
    for path in console.rglob("*"):
        if path.is_file():
            name = path.relative_to(console).as_posix()
            assert f"llmgwctl/control/console/{name}" in names, name


def test_installed_copy_validates_with_its_own_schema(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run([sys.executable, "-c", "import llmgwctl.catalog.loader as l; print(l.schema_path())"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    schema = Path(where.stdout.strip())
    assert schema.is_file() and target in schema.parents, where.stdout + where.stderr
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "catalog", "validate", str(REPO / "catalogs")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("valid: "), out.stderr


def test_every_directory_of_code_is_a_package_in_the_wheel(wheel):
    # `packages = find:` skips a directory without __init__.py, and an editable
    # install hides that: `llmgwctl serve` then failed only once installed.
    names = set(zipfile.ZipFile(wheel).namelist())
    code_dirs = {p.parent for p in (REPO / "llmgwctl").rglob("*.py") if "__pycache__" not in p.parts}
    for directory in sorted(code_dirs):
        rel = directory.relative_to(REPO).as_posix()
        assert (directory / "__init__.py").is_file(), f"{rel} holds Python files but is not a package"
        assert f"{rel}/__init__.py" in names, f"{rel} is missing from the wheel"


def test_wheel_metadata_names_the_licence_pythons_and_project(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (licence,) = [n for n in names if n.endswith((".dist-info/LICENSE", ".dist-info/licenses/LICENSE"))]
        assert z.read(licence) == (REPO / "LICENSE").read_bytes()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0, January 2004" in (REPO / "LICENSE").read_text()
    assert "License: Apache-2.0" in metadata
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    floor = cfg["options"]["python_requires"].removeprefix(">=")
    assert floor == "3.10"
    for minor in (10, 11, 12, 13):
        assert f"Classifier: Programming Language :: Python :: 3.{minor}\n" in metadata
    assert "Project-URL: Source, https://github.com/OWNER/llmgw" in metadata


CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: wheel-chat
    aliases: [default]
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh virtualenv with only the wheel installed in it; dependencies come from the interpreter running us."""
    root = tmp_path_factory.mktemp("venv")
    env = _clean_env()
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)],
                   check=True, timeout=120, capture_output=True, env=env)
    python = root / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        # We run in a virtualenv ourselves: --system-site-packages reaches the
        # base interpreter's packages, not the ones our dependencies are in.
        # A path line (not an import line) adds those directories and nothing
        # else: an editable install of llmgw among them is a .pth there, which
        # is only read for a site directory, never for a directory a .pth adds.
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, timeout=60, capture_output=True, text=True, env=env).stdout.strip()
        ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        Path(site, "_llmgw_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, timeout=300, capture_output=True, env=env)
    return root


def _clean_env() -> dict[str, str]:
    # No PYTHONPATH (the suite runs with the work tree on it) and no virtualenv
    # of ours leaking into the child's idea of where it runs.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _in_venv(venv: Path, code: str, cwd: Path) -> str:
    out = subprocess.run([venv / "bin" / "python", "-c", code], env=_clean_env(), cwd=cwd,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_installed_copy_is_the_one_imported_and_finds_its_schemas_and_man_pages(venv, tmp_path):
    where = Path(_in_venv(venv, "import llmgwctl; print(llmgwctl.__file__)", tmp_path))
    assert venv in where.parents, f"llmgwctl came from {where}, not the wheel installed in {venv}"
    for code in ("import llmgwctl.catalog.loader as m; print(m.schema_path())",
                 "import llmgwctl.control.schemas as m; print(m.SCHEMAS / 'agent-report.schema.json')"):
        found = Path(_in_venv(venv, code, tmp_path))
        assert found.is_file() and venv in found.parents, (code, found)
    man = Path(_in_venv(venv, "import importlib.resources as r; print(r.files('llmgwctl') / '_data' / 'man')", tmp_path))
    assert venv in man.parents and sorted(p.name for p in man.iterdir()) == sorted(os.listdir(REPO / "man"))
    # ...and where `man` looks: the prefix's share/man, beside the scripts.
    for page in os.listdir(REPO / "man"):
        section = page.rsplit(".", 1)[1]
        assert (venv / "share" / "man" / f"man{section}" / page).read_bytes() == (REPO / "man" / page).read_bytes()
    assert (venv / "share" / "llmgw" / "schemas" / "catalog.schema.json").is_file()


def test_installed_serve_answers_a_chat_through_its_router(venv, tmp_path):
    # The command a user types, from the wheel's console script, on a catalog
    # with only the fake engine, its local agent starting the engine.
    home = tmp_path / "cwd"
    home.mkdir()
    fleet = Fleet(home, command=[str(venv / "bin" / "llmgwctl")], environ=_clean_env())
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1")
        proc = fleet.controller
        wait_until(lambda: proc.poll() is not None or fleet.ready("wheel-chat"), "the local agent's replica ready",
                   errors=(requests.RequestException,))
        assert proc.poll() is None, fleet.log("serve")[-3000:]
        reply = fleet.chat("default")
        assert reply.status_code == 200, reply.text
        # Asked by alias: answered by wheel-chat, under the alias asked.
        assert reply.json()["model"] == "default"
        assert "model=wheel-chat" in reply.json()["choices"][0]["message"]["content"]
        # The engine the agent started is the installed copy's too.
        (replica,) = fleet.replicas()
        engine = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")
        assert engine[0].decode() == str(venv / "bin" / "python"), engine
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, fleet.log("serve")[-3000:]
        assert "No module named" not in fleet.log("serve")
    finally:
        fleet.close()
