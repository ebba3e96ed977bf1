"""Autoscaling end to end: `llmgwctl serve` with fake engines, load from clients, replicas following it.

Six streams held open on a model whose replicas should carry two each make it
scale to three; once the streams end and the (short) stable window has passed,
it goes back to one. Waits are bounded; nothing here judges a duration.
"""
import threading

from .fleet import Fleet, hold_streams, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: scaled
    replicas: {min: 1, max: 3}
    autoscale: {metric: inflight, target: 2, scale_down_window: 3s, max_step: 1}
    profiles:
      - {name: cpu, engine: fake, gpus: 0, args: ["--tokens-per-second", "20", "--startup-delay", "0.5"]}
"""


def model_status(fleet: Fleet) -> dict:
    return next(m for m in fleet.status()["models"] if m["name"] == "scaled")


def test_load_scales_a_model_up_and_after_the_window_back_down(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    stop = threading.Event()
    threads = []
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: fleet.ready("scaled"), "the first replica ready")
        threads = hold_streams(fleet.router, stop, "scaled")
        # 6 in flight on one replica at 2 each: needs 3, 3x the target (the fast path).
        wait_until(lambda: len(fleet.ready("scaled")) == 3, "three ready replicas under load", timeout=90)
        status = model_status(fleet)
        assert status["desired"] == 3 and status["autoscale"]["target"] == 2
        assert status["autoscale"]["metric"] == "inflight"
        ups = [e["message"] for e in fleet.status()["events"] if e["kind"] == "scale-up"]
        assert ups and "inflight" in ups[0] and "target 2 each" in ups[0], ups
        stop.set()
        for t in threads:
            t.join(timeout=30)
        wait_until(lambda: model_status(fleet)["desired"] == 1 and len(fleet.replicas("scaled")) == 1,
                   "back to one replica after the window", timeout=90)
        downs = [e["message"] for e in fleet.status()["events"] if e["kind"] == "scale-down"]
        assert downs and "needed throughout the last 3s" in downs[-1], downs
        assert fleet.chat("scaled").status_code == 200, "the replica left serves"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        fleet.close()
