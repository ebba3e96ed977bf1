"""Bad and half-written catalog edits against a real `llmgwctl serve` with fake engines (issue 13 items 2, 6, 9).

Throughout, a poller records every catalog version in force and the router's
/healthz is asked after every edit: it must answer, no version but the ones
meant may ever be in force, and the replicas running before are the very
same processes after (none drained, stopped or restarted by a bad edit).
"""
import os
import time

import pytest
import requests

from llmgwctl.catalog import load_dir
from tests.e2e.fleet import wait_until
from tests.faults.test_catalog_edits import VersionsInForce

pytestmark = pytest.mark.timeout(240)

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: first
    profiles: [{engine: fake, gpus: 0}]
  - name: second
    aliases: [two]
    profiles: [{engine: fake, gpus: 0}]
"""


def healthz_answers(fleet) -> None:
    # The router's /healthz, asked while the controller digests a bad edit.
    assert requests.get(fleet.router + "/healthz", timeout=2).status_code == 200


def running(fleet) -> dict:
    return {r["model"]: (r["id"], r["pid"]) for r in fleet.replicas() if r["state"] == "ready"}


def catalog_status(fleet) -> dict:
    return fleet.status()["catalog"]


def test_half_written_and_hostile_edits_cost_nothing(fleet, tmp_path):
    path = fleet.catalogs / "models.yaml"
    path.write_text(CATALOG)
    fleet.start_controller()
    fleet.start_agent("n1", "none")
    wait_until(lambda: fleet.ready("first") and fleet.ready("second"), "both models ready")
    before = running(fleet)
    meant = {load_dir(fleet.catalogs).version}

    with VersionsInForce(fleet.control) as versions:
        # 1. Rewritten in place, with the writer pausing after the first model:
        #    the half file drops `second`; it must never be in force.
        cut = CATALOG.index("  - name: second")
        for pause in (0.02, 0.05, 0.2):
            start = catalog_status(fleet)
            with open(path, "w") as f:
                f.write(CATALOG[:cut])
                f.flush()
                time.sleep(pause)      # the writer's pause: the scenario, not a wait for readiness
                f.write(CATALOG[cut:])
            # A marker renamed in afterwards shows the watcher has taken both.
            marker = fleet.catalogs / "marker.yaml"
            tmp = fleet.catalogs / ".marker.yaml.tmp"
            tmp.write_text(CATALOG.replace("first", f"marker{int(pause * 1000)}").split("  - name: second")[0])
            os.rename(tmp, marker)
            meant.add(load_dir(fleet.catalogs).version)
            wait_until(lambda start=start: catalog_status(fleet)["swaps"] > start["swaps"], f"the marker after a {pause}s pause")
            healthz_answers(fleet)
            assert catalog_status(fleet)["rejections"] == start["rejections"], "the half file was validated"

        # 2. Hostile edits: each rejected, the catalog in force stays, the router answers.
        bomb = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] + [
            f"a{i}: &a{i} [" + ",".join(f"*a{i - 1}" for _ in range(9)) + "]" for i in range(1, 10)]
        edits = [
            ("nan.yaml", lambda p: p.write_text(CATALOG.replace("first", "nanny").replace("second", "nanny2")
                                                .replace("gpus: 0}", "gpus: 0, weight: .nan}")
                                                + "    idle_timeout: .nan\n"), "not a finite number"),
            ("bomb.yaml", lambda p: p.write_text("apiVersion: llmgw/v1\nkind: Catalog\n" + "\n".join(bomb) + "\n"),
             "YAML nodes"),
            ("fifo.yaml", lambda p: os.mkfifo(p), "is a FIFO"),
            ("zero.yaml", lambda p: os.symlink("/dev/zero", p), "outside the catalog directory"),
            ("passwd.yaml", lambda p: os.symlink("/etc/passwd", p), "outside the catalog directory"),
        ]
        for name, make, words in edits:
            start = catalog_status(fleet)
            make(fleet.catalogs / name)
            wait_until(lambda start=start: catalog_status(fleet)["rejections"] > start["rejections"], f"{name} rejected")
            healthz_answers(fleet)
            status = catalog_status(fleet)
            errors = "\n".join(status["last_rejection"]["errors"])
            assert words in errors, errors
            assert "root:" not in errors and status["watcher"] == "ok" and status["failures"] == 0
            (fleet.catalogs / name).unlink()
            wait_until(lambda: catalog_status(fleet)["directory_valid"], f"valid again after {name}")

        # 3. The same .nan posted to the control API: a 4xx with the reason, never a 500.
        resp = requests.post(fleet.control + "/api/v1/catalog", timeout=30, json={
            "filename": "nan.yaml", "content": CATALOG.replace("first", "x").replace("second", "y")
            .replace("gpus: 0}", "gpus: 0, weight: .nan}")})
        assert resp.status_code == 422 and "not a finite number" in resp.text, resp.text
        resp = requests.post(fleet.control + "/api/v1/catalog", timeout=30,
                             data='{"filename": "s.yaml", "content": "\\ud800"}',
                             headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text

        # 4. A valid edit after all that is in force as usual.
        tmp = fleet.catalogs / ".models.yaml.tmp"
        tmp.write_text(CATALOG.replace("aliases: [two]", "aliases: [two, deux]"))
        os.rename(tmp, path)
        meant.add(load_dir(fleet.catalogs).version)
        wait_until(lambda: fleet.chat("deux").status_code == 200, "the valid edit in force")
    assert set(versions.seen) <= meant, versions.seen
    after = running(fleet)
    assert {m: after.get(m) for m in before} == before, "a replica was restarted by a bad or half edit"
