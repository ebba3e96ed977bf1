"""Scenario 1: 100 catalog swaps in a row under steady streaming load.

Aliases come and go, models are added and removed (some scale-to-zero, some
with a replica that gets placed, started and drained), and the stable models'
weights change -- every swap is waited into force before the next, so all
100 really happen. Clients of the two models that stay in the catalog (by
name and by a stable alias) must see no failure at all.
"""
import os
import tempfile
import time

import requests

from llmgwctl.catalog import load_text
from tests.e2e.fleet import wait_until

from .load import SteadyLoad, summary

SWAPS = 100
STABLE = ["steady", "st", "other"]


def catalog(i: int) -> str:
    aliases = ["st"] + ([f"alias-{i}"] if i % 2 else [])
    text = f"""\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: steady
    aliases: [{", ".join(aliases)}]
    replicas: 2
    profiles: [{{name: cpu, engine: fake, gpus: 0, weight: {1 + i % 3}}}]
  - name: other
    profiles: [{{name: cpu, engine: fake, gpus: 0}}]
"""
    if i % 4 in (1, 2):     # a scale-to-zero model: in the catalog, no engine
        text += f"  - name: lazy-{i // 4}\n    replicas: {{min: 0, max: 1}}\n    idle_timeout: 1m\n" \
                "    profiles: [{engine: fake, gpus: 0}]\n"
        if i % 4 == 2:
            text += f"    aliases: [lazy-alias-{i}]\n"
    if i % 10 in (3, 4, 5, 6):  # a model with a real replica for a few swaps: placed, started, drained
        text += "  - name: hot\n    profiles: [{engine: fake, gpus: 0}]\n"
    return text


def write_atomically(directory, name: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, name))


def test_100_swaps_under_streaming_load_fail_no_request_to_a_model_that_stayed(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(catalog(0))
    fleet.start_controller()
    fleet.start_agent("n1", "none")
    fleet.start_agent("n2", "none")
    wait_until(lambda: len(fleet.ready("steady")) == 2 and fleet.ready("other"), "stable models ready")
    swaps_before = fleet.status()["catalog"]["swaps"]

    with SteadyLoad(fleet.router, STABLE, workers=4) as load:
        load.wait_for(20)
        started = time.monotonic()
        for i in range(1, SWAPS + 1):
            text = catalog(i)
            version = load_text(text).version
            if i % 2:   # half through the control API (`catalog apply`), half as an edit in the directory
                resp = requests.post(fleet.control + "/api/v1/catalog", timeout=30,
                                     json={"filename": "models.yaml", "content": text})
                assert resp.status_code == 200, resp.text
            else:
                write_atomically(fleet.catalogs, "models.yaml", text)
            wait_until(lambda version=version: requests.get(fleet.control + "/api/v1/catalog", timeout=5).json()["version"] == version,
                       f"swap {i} in force", every=0.01)
        swapping = time.monotonic() - started
        load.wait_for(20)   # and a little after the last swap, while the last drain finishes
    outcomes = load.outcomes

    status = fleet.status()
    swaps = status["catalog"]["swaps"] - swaps_before
    failed = load.failures()
    figure(f"{swaps} swaps in {swapping:.1f} s under load; {summary(outcomes)} "
           f"to models that stayed ({len([o for o in outcomes if started <= o.started <= started + swapping])} "
           f"started during the swaps)")
    assert swaps == SWAPS
    assert failed == [], failed[:5]
    assert status["catalog"]["rejections"] == 0
    wait_until(lambda: not fleet.replicas("hot") and len(fleet.ready("steady")) == 2, "the fleet back to the last catalog")
