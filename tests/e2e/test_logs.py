"""Why a replica failed, from the operator's seat: status carries its last lines, `llmgwctl logs` its whole log.

A real `llmgwctl serve` (its local agent in-process, speaking the agent
protocol over HTTP like any other) runs one engine that crashes with a CUDA
out-of-memory message and one that logs every request. Both logs are read
through the controller only: nothing here opens the agent's state directory.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading

from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: fake-chat
    profiles: [{name: cpu, engine: fake, gpus: 0, args: ["--log-requests"]}]
  - name: crashy
    profiles: [{name: cpu, engine: fake, gpus: 0, args: ["--crash-after", "0.2"]}]
"""
OOM = "CUDA out of memory"


def _llmgwctl(fleet: Fleet, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgwctl", *args, "--controller", fleet.control],
                          capture_output=True, text=True, timeout=timeout)


def test_status_and_logs_show_why_a_replica_failed_and_follow_a_live_log(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1")
        crashed = wait_until(lambda: [r for r in fleet.replicas("crashy")
                                      if r["last_exit"] == 3 and any(OOM in line for line in r["last_log"])],
                             "the crashed engine's exit code and last lines in status")[0]

        # The table says why, with the engine's own words, without -o json.
        table = _llmgwctl(fleet, "status")
        assert table.returncode == 0, table.stderr
        assert crashed["id"] in table.stdout and OOM in table.stdout
        assert re.search(r"(code|exit) 3\b", table.stdout), table.stdout
        wide = _llmgwctl(fleet, "status", "-o", "wide")
        assert wide.returncode == 0 and re.search(r"^REPLICA .* EXIT$", wide.stdout, re.M), wide.stdout
        # The engine's error line is longer than a table cell may be; wide prints it whole.
        oom_line = next(line for line in crashed["last_log"] if OOM in line)
        assert len(f"    | {oom_line}") > 100 and f"| {oom_line}" in wide.stdout

        # The whole log, through the controller, from the agent.
        out = _llmgwctl(fleet, "logs", crashed["id"], "--tail", "5")
        assert out.returncode == 0, out.stderr
        assert OOM in out.stdout
        assert len(out.stdout.splitlines()) <= 5
        assert "Traceback" not in out.stderr

        # A replica the controller does not know: exit 1 and what to do.
        missing = _llmgwctl(fleet, "logs", "no-such-replica")
        assert missing.returncode == 1 and "llmgwctl status" in missing.stderr

        # -f prints lines the engine writes after it started.
        (live,) = wait_until(lambda: fleet.ready("fake-chat"), "fake-chat ready")
        follower = subprocess.Popen([sys.executable, "-m", "llmgwctl", "logs", live["id"], "-f", "--tail", "0",
                                     "--controller", fleet.control], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.extend(iter(follower.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            def a_request_logged():
                fleet.chat("fake-chat")
                return any('"POST /v1/chat/completions" 200' in line for line in seen)
            wait_until(a_request_logged, "a request's log line printed by llmgwctl logs -f", every=0.5)
            assert follower.poll() is None, follower.stderr.read()
        finally:
            follower.terminate()
            follower.wait(timeout=30)
            reader.join(timeout=10)
        # The follower's going away ends the agent's stream too: none is left open.
        wait_until(lambda: fleet.status()["log_streams"] == 0, "the relay's stream closed after its reader left")
    finally:
        fleet.close()


def test_logs_requests_prints_the_request_log_filtered_by_id_model_and_status(tmp_path):
    import json

    import requests

    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: fleet.ready("fake-chat"), "fake-chat ready")
        ok = requests.post(fleet.router + "/v1/chat/completions", headers={"X-Request-Id": "cli-find-me"}, timeout=30,
                           json={"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
        assert fleet.chat("no-such-model").status_code == 404
        found = _llmgwctl(fleet, "logs", "--requests", "--id", "cli-find-me", "-o", "json")
        assert found.returncode == 0, found.stderr
        (entry,) = json.loads(found.stdout)
        assert entry["model"] == "fake-chat" and entry["status"] == 200 and entry["tokens_out"] > 0
        table = _llmgwctl(fleet, "logs", "--requests", "--status", "4xx")
        assert table.returncode == 0, table.stderr
        assert "404" in table.stdout and "no-such-model" in table.stdout and "cli-find-me" not in table.stdout
        by_model = _llmgwctl(fleet, "logs", "--requests", "--model", "fake-chat")
        assert "cli-find-me" in by_model.stdout and "no-such-model" not in by_model.stdout
        bad = _llmgwctl(fleet, "logs", "--requests", "--status", "nope")
        assert bad.returncode == 1 and "status must be" in bad.stderr
        usage = _llmgwctl(fleet, "logs", "--requests", "some-replica")
        assert usage.returncode == 2
    finally:
        fleet.close()
