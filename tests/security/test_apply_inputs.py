"""`catalog apply` bounds what it is sent: file names, and how many validations run at once.

Against a real `llmgwctl serve` on loopback, as an operator's script (or
anything that can reach the control API) would send them: a file name that
is not a plain catalog name is a 400 naming the rule and writes nothing, and
a valid apply after it is in force as usual; applies sent side by side are
validated one at a time (the controller's peak memory, read from /proc, stays
near one validation's, not six), every one is answered, and two that race
come out as if sent one after the other.
"""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import pytest
import requests

from tests.e2e.fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: first
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def extra(name: str) -> str:
    return CATALOG.replace("first", name)


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_controller()
        yield fleet
    finally:
        fleet.close()


def apply(fleet: Fleet, filename, content: str, dry_run: bool = False, timeout: float = 150) -> requests.Response:
    return requests.post(fleet.control + "/api/v1/catalog" + ("?dry_run=1" if dry_run else ""),
                         json={"filename": filename, "content": content}, timeout=timeout)


HOSTILE_NAMES = ["x\x00.yaml", "a" * 295 + ".yaml", "x\n.yaml", "x.yaml\n", "\u202elmay.x", "evil\u202e.yaml",
                 "../x.yaml", "sub/x.yaml", "/tmp/x.yaml", ".hidden.yaml", "x\x1b[2J.yaml", "x\r.yaml", "", 7, None]


def test_a_file_name_outside_the_rule_is_a_400_naming_it_and_writes_nothing(fleet, tmp_path):
    before = sorted(os.listdir(fleet.catalogs))
    outside = sorted(os.listdir(tmp_path))
    for name in HOSTILE_NAMES:
        for dry_run in (True, False):
            resp = apply(fleet, name, extra("second"), dry_run=dry_run)
            assert resp.status_code == 400, (name, resp.status_code, resp.text[:300])
            message = resp.json()["error"]["message"]
            assert "filename" in message, message
            if isinstance(name, str):
                assert "A-Z a-z 0-9" in message and ".yaml or .yml" in message, message
    assert sorted(os.listdir(fleet.catalogs)) == before, "nothing was written into the catalog directory"
    assert sorted(os.listdir(tmp_path)) == outside, "nor beside it"
    # The controller serves on, and the next valid apply is in force as usual.
    assert requests.get(fleet.control + "/healthz", timeout=5).ok
    resp = apply(fleet, "second.yaml", extra("second"))
    assert resp.status_code == 200 and resp.json()["in_force"] is True, resp.text[:300]
    names = {m["name"] for m in fleet.status()["models"]}
    assert names == {"first", "second"}


def test_the_cli_refuses_such_a_name_before_sending_it(fleet, tmp_path):
    hostile = tmp_path / "evil\u202e.yaml"
    hostile.write_text(extra("second"))
    run = subprocess.run([sys.executable, "-m", "llmgwctl", "catalog", "apply", "-f", str(hostile),
                          "--controller", fleet.control], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "A-Z a-z 0-9" in run.stderr and "--as NAME.yaml" in run.stderr, run.stderr
    assert "\u202e" not in run.stderr and "\\u202e" in run.stderr, "the name is shown escaped"
    named = subprocess.run([sys.executable, "-m", "llmgwctl", "catalog", "apply", "-f", str(hostile),
                            "--as", "second.yaml", "--controller", fleet.control],
                           capture_output=True, text=True, timeout=150)
    assert named.returncode == 0, (named.stdout, named.stderr)
    assert os.listdir(fleet.catalogs) and "second.yaml" in os.listdir(fleet.catalogs)


# About 3.4 MB of YAML: a big but valid catalog, as the one whose parallel validations took a gigabyte.
BIG_MODELS = 3700


def big_catalog() -> str:
    model = ("  - name: big-{i}\n"
             "    aliases: [big-alias-{i}]\n"
             "    replicas: {{min: 0, max: 2}}\n"
             "    idle_timeout: 15m\n"
             "    profiles:\n"
             "      - name: cpu\n"
             "        engine: fake\n"
             "        gpus: 0\n"
             "        args: [\"--tokens-per-second\", \"50\", \"--startup-delay\", \"0\", \"--model-tag\", \"{pad}\"]\n"
             "        env: {{LLMGW_FAKE_NOTE: \"{pad}\"}}\n")
    pad = "p" * 120
    return "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n" + "".join(model.format(i=i, pad=pad)
                                                                     for i in range(BIG_MODELS))


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set so far (VmHWM): no sampling can miss a peak."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/PID/status")


def serve_pid(fleet: Fleet) -> int:
    return fleet.controller.pid


def test_six_dry_runs_side_by_side_are_validated_one_at_a_time_and_all_answered(fleet):
    content = big_catalog()
    assert len(content.encode()) > 1_900_000   # just under the loader's 2 MiB per file
    pid = serve_pid(fleet)
    base = peak_rss_kib(pid)
    one = apply(fleet, "big.yaml", content, dry_run=True)
    assert one.status_code == 200, one.text[:500]
    single = peak_rss_kib(pid) - base      # what one validation (and its body) costs at its peak
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: apply(fleet, "big.yaml", content, dry_run=True), range(6)))
    assert [a.status_code for a in answers] == [200] * 6, [a.text[:200] for a in answers]
    assert all(a.json()["dry_run"] and len(a.json()["diff"]["added"]) == BIG_MODELS for a in answers)
    six = peak_rss_kib(pid) - base
    # Six validations at once held six parsed catalogs (about six times one); one at a time holds one,
    # plus the bodies waiting their turn. Generous: twice one validation and 100 MB on top.
    assert six < 2 * single + 100 * 1024, f"peak grew {six} KiB for six dry runs, {single} KiB for one"
    assert "big.yaml" not in os.listdir(fleet.catalogs), "a dry run writes nothing"
    assert requests.get(fleet.control + "/healthz", timeout=5).ok


def test_two_applies_that_race_come_out_as_one_after_the_other(fleet):
    first_version = requests.get(fleet.control + "/api/v1/catalog", timeout=10).json()["version"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda name: apply(fleet, f"{name}.yaml", extra(name)), ["second", "third"])
    assert a.status_code == b.status_code == 200, (a.text[:300], b.text[:300])
    plans = sorted((a.json(), b.json()), key=lambda p: p["from_version"] != first_version)
    assert plans[0]["in_force"] and plans[1]["in_force"], plans
    # The second was planned against the catalog the first put in force, and adds only its own model.
    assert plans[0]["from_version"] == first_version
    assert plans[1]["from_version"] == plans[0]["to_version"], plans
    assert len(plans[0]["diff"]["added"]) == len(plans[1]["diff"]["added"]) == 1, plans
    wait_until(lambda: {m["name"] for m in fleet.status()["models"]} == {"first", "second", "third"},
               "both applies in force")
