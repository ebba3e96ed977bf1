"""`llmgwctl engine ...` through click's runner (in process) and as a real process."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

from click.testing import CliRunner

from llmgwctl.cli import main


def test_engine_list_reports_every_builtin_with_a_reason():
    result = CliRunner().invoke(main, ["engine", "list", "-o", "json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert set(found) == {"vllm", "sglang", "llamacpp", "fake"}
    assert found["fake"] == {"available": True, "reason": "built in"}
    assert all(entry["reason"] for entry in found.values())


def test_engine_fake_rejects_bad_options_with_usage_errors():
    runner = CliRunner()
    for args, word in ((["--port", "1"], "--model"), (["--model", "m", "--port", "1", "--fail-rate", "2"], "--fail-rate"),
                       (["--model", "m", "--port", "1", "--max-num-seqs", "0"], "--max-num-seqs")):
        result = runner.invoke(main, ["engine", "fake", *args])
        assert result.exit_code == 2 and word in result.output, result.output


def test_engine_fake_on_a_taken_port_exits_1_saying_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "llmgwctl", "engine", "fake", "--model", "m", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
