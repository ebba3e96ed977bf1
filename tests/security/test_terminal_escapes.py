"""What the CLI prints for people shows control characters escaped; it never sends them to the terminal.

File names, pool labels, node names, engine log lines, event and error
messages reach `llmgwctl status`, `logs` and every table from catalogs,
nodes, engines and the server. Any of them can carry an ESC sequence (here
ESC[2J, clear the screen), a carriage return, backspaces or a bidi override
(U+202E). Each is printed as a visible escape (`\\x1b`, `\\u202e`), once;
`-o json` stays exact JSON. Shown against a real `serve` (a catalog file
with a hostile name, a pool label, an engine that prints a hostile line) and
on the renderer with every field hostile at once.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llmgwctl.cli.output import dump, table, visible
from llmgwctl.cli.status import render
from tests.e2e.fleet import Fleet, wait_until

CLEAR = "\x1b[2J"
RLO = "\u202e"
HOSTILE = f"a{CLEAR}b{RLO}c\rd\x08e\x9bf\u2028g"
# Anything a terminal acts on rather than shows, but the newlines between lines.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def assert_escaped(text: str, *shown: str) -> None:
    found = RAW.search(text)
    assert found is None, f"raw {found.group()!r} in output: {text[max(0, found.start() - 60):found.end() + 60]!r}"
    for s in shown:
        assert s in text, f"{s!r} not shown in {text[:2000]!r}"


def test_visible_escapes_each_character_once_and_leaves_text_alone():
    assert visible(HOSTILE) == "a\\x1b[2Jb\\u202ec\\rd\\x08e\\x9bf\\u2028g"
    assert visible("plain ascii, é, 日本, emoji \U0001f600, back\\slash") == "plain ascii, é, 日本, emoji \U0001f600, back\\slash"
    assert visible("a\tb\nc") == "a\\tb\\nc"
    assert visible("a\tb\nc", keep="\t\n") == "a\tb\nc"
    assert visible(None) == "" and visible(3) == "3"
    assert visible("\U000e0001tag") == "\\U000e0001tag"


def test_tables_escape_every_cell_and_keep_their_rows():
    out = table(("NAME", "POOL"), [(HOSTILE, "x\ny")])
    assert_escaped(out, "a\\x1b[2Jb\\u202ec", "x\\ny")
    assert len(out.splitlines()) == 2, "a newline in a cell does not start a row"


def test_yaml_output_escapes_what_json_escapes_and_both_read_back_exact():
    data = {"name": HOSTILE, "pool": f"gpu{RLO}"}
    assert json.loads(dump(data, "json")) == data
    assert_escaped(dump(data, "json"))
    import yaml
    text = dump(data, "yaml")
    assert yaml.safe_load(text) == data
    assert_escaped(text)


def hostile_status() -> dict:
    return {
        "settled": True,
        "catalog": {"version": f"v1{CLEAR}", "models": 1, "swapped_at": 1000.0, "directory": f"/cat{RLO}logs",
                    "directory_valid": False,
                    "last_rejection": {"at": 990.0, "errors": [f"/cat/evil{CLEAR}{RLO}.yaml:1:1: bad\nforged line"]}},
        "models": [{"name": f"m{CLEAR}", "aliases": [f"al{RLO}"], "desired": 1, "ready": 0, "min": 1, "max": 1,
                    "unplaceable": f"no node has pool 'gpu{CLEAR}{RLO}'"}],
        "replicas": [{"id": "r-1", "model": "m", "profile": f"p{CLEAR}", "node": f"node{RLO}", "gpus": [],
                      "state": "failed", "url": None, "restarts": 1, "idle_seconds": None, "engine": "fake",
                      "reason": f"exit{CLEAR}", "last_exit": 2, "last_log": [f"Error: No such option: --x{CLEAR}{RLO}",
                                                                             "progress\r50%\x08"]}],
        "nodes": [{"name": f"node{RLO}", "state": "ready", "pools": [f"gpu{CLEAR}", f"h100{RLO}"], "gpus_used": 0,
                   "gpus": 0, "engines": [f"fake{CLEAR}"], "last_seen_seconds": 1, "conflict": f"two{CLEAR}"}],
        "events": [{"at": 999.0, "kind": f"catalog-applied{RLO}", "message": f"evil{CLEAR}.yaml written\n  forged"}],
    }


@pytest.mark.parametrize("wide", [False, True])
def test_status_renders_every_hostile_field_escaped(wide):
    out = render(hostile_status(), now=1000.0, wide=wide)
    assert_escaped(out, "evil\\x1b[2J\\u202e.yaml", "gpu\\x1b[2J\\u202e", "node\\u202e", "--x\\x1b[2J\\u202e",
                   "progress\\r50%\\x08", "h100\\u202e", "written\\n  forged")
    assert "\nforged line" not in out and "\n  forged" not in out, "a value's newline does not forge a line"


def test_status_command_prints_escaped_and_json_exact(monkeypatch):
    from llmgwctl.cli import status as status_cli
    monkeypatch.setattr(status_cli, "fetch", lambda controller, model=None: hostile_status())
    result = CliRunner().invoke(status_cli.command, [])
    assert result.exit_code == 0, result.output
    assert_escaped(result.output, "gpu\\x1b[2J\\u202e")
    as_json = CliRunner().invoke(status_cli.command, ["-o", "json"])
    assert json.loads(as_json.output) == hostile_status()
    assert_escaped(as_json.output)


# --- against a real serve ----------------------------------------------------------------------------

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: plain
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: crashing
    profiles: [{name: cpu, engine: fake, gpus: 0, args: ["--model", "evil\\e[2J\\u202emodel", "--crash-after", "1"]}]
  - name: pooled
    replicas: 1
    profiles: [{name: gpu, engine: fake, gpus: 0, pool: "gpu\\e[2J\\u202e"}]
"""


def llmgwctl(fleet: Fleet, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgwctl", *args, "--controller", fleet.control],
                          capture_output=True, timeout=60)


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1")
        yield fleet
    finally:
        fleet.close()


def test_status_and_logs_of_a_real_serve_show_hostile_names_and_lines_escaped(fleet):
    wait_until(lambda: fleet.ready("plain"), "the plain model ready")
    (fleet.catalogs / f"evil{CLEAR}{RLO}.yaml").write_text("models: [\n")
    wait_until(lambda: fleet.status()["catalog"].get("last_rejection"), "the hostile file rejected")
    # The engine prints the model name it serves on its first line, then crashes: its log is in status.
    crashed = wait_until(lambda: [r for r in fleet.replicas("crashing")
                                  if any(CLEAR in line for line in r.get("last_log") or [])],
                         "the crashing engine's log in status")
    raw_log = "\n".join(crashed[0]["last_log"])
    assert CLEAR in raw_log, "the engine did print the hostile line (else this test shows nothing)"

    status = llmgwctl(fleet, "status")
    assert status.returncode == 0, status.stderr
    out = status.stdout.decode()
    assert_escaped(out, "evil\\x1b[2J\\u202e.yaml", "\\x1b[2J\\u202emodel", "gpu\\x1b[2J\\u202e")

    wide = llmgwctl(fleet, "status", "-o", "wide")
    assert_escaped(wide.stdout.decode(), "\\x1b[2J\\u202emodel")

    exact = json.loads(llmgwctl(fleet, "status", "-o", "json").stdout)
    assert any(CLEAR in line for r in exact["replicas"] for line in r.get("last_log") or []), "json stays exact"

    logs = llmgwctl(fleet, "logs", crashed[0]["id"])
    assert logs.returncode == 0, logs.stderr
    text = logs.stdout.decode()
    assert_escaped(text, "\\x1b[2J\\u202emodel")
    assert text.count("\n") >= 1, "lines stay lines"

    missing = llmgwctl(fleet, "logs", f"r-{CLEAR}")
    assert missing.returncode == 1
    assert_escaped(missing.stderr.decode(), "\\x1b[2J")


def test_catalog_validate_and_show_print_hostile_names_escaped(tmp_path):
    from llmgwctl.cli.catalog import command as catalog_cli
    good = tmp_path / "good"
    good.mkdir()
    (good / "models.yaml").write_text(CATALOG.replace('pool: "gpu', 'pool: "h100'))
    shown = CliRunner().invoke(catalog_cli, ["show", str(good)])
    assert shown.exit_code == 0, shown.output
    assert_escaped(shown.output, "h100\\x1b[2J\\u202e")
    (good / f"evil{CLEAR}{RLO}.yaml").write_text("models: [\n")
    checked = CliRunner().invoke(catalog_cli, ["validate", str(good)])
    assert checked.exit_code == 1
    assert_escaped(checked.output, "evil\\x1b[2J\\u202e.yaml")
