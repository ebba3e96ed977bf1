"""`llmgwctl catalog ...` as a user runs it: exit codes, the error form CI annotates, tables and -o."""
import json
import subprocess
import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from llmgwctl.cli import main

from .conftest import catalog_yaml

REPO = Path(__file__).resolve().parents[2]


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_bundled_catalogs_are_valid():
    result = run("catalog", "validate", str(REPO / "catalogs"))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("valid: ")


def test_validate_exit_codes_and_error_form(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(catalog_yaml("a"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(catalog_yaml("b").replace("engine: fake", "engine: vlm"))
    assert run("catalog", "validate", str(good)).exit_code == 0
    result = run("catalog", "validate", str(good), str(bad))
    assert result.exit_code == 1
    assert f"{bad}:5:25: models[0].profiles[0].engine: 'vlm' is not one of fake, llamacpp, sglang, vllm" in result.output
    assert "invalid: 1 problem" in result.output
    assert run("catalog", "validate", str(tmp_path / "missing.yaml")).exit_code == 2
    assert run("catalog", "validate").exit_code == 2


def test_show_table_and_machine_formats(tmp_path):
    (tmp_path / "a.yaml").write_text(catalog_yaml("qwen:q,default", "tiny"))
    table = run("catalog", "show", str(tmp_path))
    assert table.exit_code == 0
    header, first, second = table.output.splitlines()[:3]
    assert header.split() == ["MODEL", "ALIASES", "REPLICAS", "IDLE", "PROFILE", "ENGINE", "POOL", "GPUS", "PRIO", "WEIGHT"]
    assert first.split() == ["qwen", "q,default", "1", "never", "fake", "fake", "*", "0", "0", "1"]
    assert second.split()[0] == "tiny"
    as_json = json.loads(run("catalog", "show", "-o", "json", str(tmp_path)).output)
    assert [m["name"] for m in as_json["models"]] == ["qwen", "tiny"]
    as_yaml = yaml.safe_load(run("catalog", "show", "-o", "yaml", str(tmp_path)).output)
    assert as_yaml == as_json


def test_diff_names_each_changed_field(tmp_path):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(catalog_yaml("a", "b"))
    new.write_text(catalog_yaml("a:x", "c").replace("gpus: 0}]\n  - name: c", "gpus: 0}]\n  - name: c"))
    result = run("catalog", "diff", str(old), str(new))
    assert result.exit_code == 1
    assert result.output.splitlines() == ["+ model c", "- model b", "~ model a", "    aliases: (absent) -> [x]"]
    data = json.loads(run("catalog", "diff", "-o", "json", str(old), str(new)).output)
    assert data["added"] == ["c"] and data["removed"] == ["b"]
    assert data["changed"] == {"a": [{"path": "aliases", "old": None, "new": ["x"]}]}
    same = run("catalog", "diff", str(old), str(old))
    assert same.exit_code == 0 and same.output.strip() == "no changes"


def test_diff_prints_values_as_yaml_not_python_reprs(tmp_path):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    base = ("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: m\n    profiles:\n"
            "      - {name: p, engine: fake, gpus: 0, args: %s, env: %s}\n")
    old.write_text(base % ("[--max-model-len, '4096']", "{A: one}"))
    new.write_text(base % ("[--max-model-len, '8192', --enforce-eager]", "{A: two words, B: 'yes'}"))
    lines = run("catalog", "diff", str(old), str(new)).output.splitlines()
    assert "    profiles[0].args: [--max-model-len, '4096'] -> [--max-model-len, '8192', --enforce-eager]" in lines
    assert "    profiles[0].env.A: one -> two words" in lines
    # A string YAML would read as another type stays quoted, so the diff never hides a type change.
    assert "    profiles[0].env.B: (absent) -> 'yes'" in lines
    assert not any("['" in line or "{'" in line for line in lines), lines


def test_python_dash_m_works_like_the_console_script():
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "catalog", "validate", str(REPO / "catalogs")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("valid: ")


def test_diff_shows_engines_too(tmp_path):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    head = "apiVersion: llmgw/v1\nkind: Catalog\nengines:\n"
    old.write_text(head + "  a: {command: [x]}\n  gone: {command: [g]}\n")
    new.write_text(head + "  a: {command: [y]}\n  b: {command: [z]}\n")
    result = run("catalog", "diff", str(old), str(new))
    assert result.exit_code == 1
    assert result.output.splitlines() == ["+ engine b", "- engine gone", "~ engine a", "    command: [x] -> [y]"]
