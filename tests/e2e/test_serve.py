"""`llmgwctl serve` as a user runs it: one process with its local agent answers at once, and Ctrl-C leaves nothing behind."""
import resource
import signal
import socket
import subprocess
import sys

import requests

from ..procs import free_port
from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: fake-chat
    aliases: [default]
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def test_serve_answers_with_its_local_agent_and_stops_its_engines_on_ctrl_c(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "1")
        proc = fleet.controller
        wait_until(lambda: fleet.ready("fake-chat"), "the local agent's replica ready")
        reply = fleet.chat("default")
        # Asked by its alias, answered by fake-chat (its reply says so) under the alias asked.
        assert reply.status_code == 200 and reply.json()["model"] == "default"
        assert "model=fake-chat" in reply.json()["choices"][0]["message"]["content"]
        (replica,) = fleet.replicas()
        engine_pid = replica["pid"]
        assert engine_pid in fleet.marked_pids()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, fleet.log("serve")[-2000:]
        # Ctrl-C drains and stops the local engines: nothing of ours is left running.
        wait_until(lambda: fleet.marked_pids() == [], "every process gone", timeout=30)
        assert "stopped" in fleet.log("serve")
    finally:
        fleet.close()


def test_serve_refuses_an_invalid_catalog_with_its_errors(tmp_path):
    catalogs = tmp_path / "catalogs"
    catalogs.mkdir()
    (catalogs / "bad.yaml").write_text("apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: x\n    profiles: [{engine: vlm}]\n")
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "serve", "--catalogs", str(catalogs), "--no-local-agent",
                          "--listen", f"127.0.0.1:{free_port()}", "--control", f"127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"{catalogs}/bad.yaml:5:25: models[0].profiles[0].engine: 'vlm' is not one of" in out.stderr
    assert "is not a valid catalog" in out.stderr


def test_serve_reports_an_address_in_use_as_an_error_not_a_traceback(tmp_path):
    catalogs = tmp_path / "catalogs"
    catalogs.mkdir()
    (catalogs / "models.yaml").write_text(CATALOG)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "llmgwctl", "serve", "--catalogs", str(catalogs),
                              "--no-local-agent", "--listen", f"127.0.0.1:{port}",
                              "--control", f"127.0.0.1:{free_port()}"],
                             capture_output=True, text=True, timeout=60)
    # click's ClickException: exit 1 and "Error: ..." on stderr, like every other command.
    assert out.returncode == 1, out.stderr
    assert f"Error: the router cannot listen on 127.0.0.1:{port}:" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_takes_the_router_options_and_lifts_its_open_file_limit(tmp_path):
    # The router inside serve is tuned with the same flags as `llmgwctl router`:
    # behind a load balancer every client shares one address, and 500 streams
    # need more than the usual 1024 open files.
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Started with a soft limit below the hard one, as on most distributions.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard - 1), hard))
    try:
        try:
            fleet.start_controller("--max-body-bytes", "2000", "--max-connections-per-client", "2")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        big = {"model": "default", "messages": [{"role": "user", "content": "x" * 3000}]}
        r = requests.post(fleet.router + "/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 413, r.text
        assert "2000" in r.json()["error"]["message"]
        held = [socket.create_connection(("127.0.0.1", fleet.router_port), timeout=10) for _ in range(2)]
        try:
            third = socket.create_connection(("127.0.0.1", fleet.router_port), timeout=10)
            third.settimeout(10)
            assert third.recv(64).startswith(b"HTTP/1.1 429")
            third.close()
        finally:
            for s in held:
                s.close()
        with open(f"/proc/{fleet.controller.pid}/limits") as f:
            (line,) = [ln for ln in f if ln.startswith("Max open files")]
        assert line.split()[3:5] == [str(hard), str(hard)], line
    finally:
        fleet.close()
