"""The top-level schemas/ and man/ reach an installed llmgwctl, not only a source checkout."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
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
