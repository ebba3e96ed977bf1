"""Weights honoured at any load (issue 15): two replicas of one model, profile weights 3 and 1, on two agents.

Sequential requests find both engines idle, so every pick is a tie of load;
the split used to be a coin toss (22:18 where 30:10 was asked for). 400
requests at 3:1 expect 300 to the heavy one, sd 8.7; the bound 250-350 is
5.8 sd from that, and 5 sd from the 200 a coin toss gives.
"""
from __future__ import annotations

import collections

import requests

from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: split
    replicas: 2
    profiles:
      - {name: heavy, engine: fake, gpus: 1, pool: a, weight: 3}
      - {name: light, engine: fake, gpus: 1, pool: b, weight: 1}
"""


def test_sequential_requests_split_by_weight(tmp_path):
    fleet = Fleet(tmp_path / "fleet")
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_controller()
        fleet.start_agent("n1", "1xL4-24GB", "a")
        fleet.start_agent("n2", "1xL4-24GB", "b")
        wait_until(lambda: len(fleet.ready("split")) == 2, "both replicas ready")
        profile = {r["id"]: r["profile"] for r in fleet.ready("split")}
        assert sorted(profile.values()) == ["heavy", "light"]
        wait_until(lambda: requests.get(fleet.router + "/v1/models/split", timeout=5).json()["llmgw"]["ready_replicas"] == 2,
                   "the router routing to both")
        got = collections.Counter()
        with requests.Session() as session:
            for _ in range(400):
                resp = session.post(fleet.router + "/v1/chat/completions", timeout=30,
                                    json={"model": "split", "messages": [{"role": "user", "content": "hi"}]})
                assert resp.status_code == 200, resp.text
                got[profile[resp.headers["x-llmgw-replica"]]] += 1
        print(f"400 sequential requests: {dict(got)} (weights heavy 3, light 1)")
        assert 250 <= got["heavy"] <= 350, got
    finally:
        fleet.close()
