"""Logs: the JSON format's shape, and a real `llmgwctl router --log-format json` writing its access log."""
from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
import requests

from llmgwctl.observability.logs import JsonFormatter, setup_logging
from tests.procs import kill_group
from tests.router.harness import _readline, static_router_args, wait_until

MODEL = "log-model"


def test_json_lines_carry_extra_fields_and_exceptions():
    record = logging.LogRecord("llmgw.reconciler", logging.INFO, __file__, 1, "%s: %s",
                               ("replica-ready", "r-1 (m/p on n1)"), None)
    record.event = "replica-ready"
    doc = json.loads(JsonFormatter().format(record))
    assert doc["msg"] == "replica-ready: r-1 (m/p on n1)" and doc["event"] == "replica-ready"
    assert doc["level"] == "info" and doc["logger"] == "llmgw.reconciler" and doc["ts"].endswith("Z")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "RuntimeError: boom" in json.loads(JsonFormatter().format(failed))["exc"]


def test_setup_logging_json_and_refuses_an_unknown_format():
    out = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging(0, "json", stream=out)
        logging.getLogger("llmgw.test").info("hello %s", "world", extra={"event": "greeting"})
        line = json.loads(out.getvalue().strip().splitlines()[-1])
        assert line["msg"] == "hello world" and line["event"] == "greeting"
        with pytest.raises(ValueError, match="'text' or 'json'"):
            setup_logging(0, "xml")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


@pytest.fixture
def router_proc(tmp_path, engines):
    engine = engines(MODEL, "log-r1")
    served = static_router_args(tmp_path, MODEL, engine.url, "log-r1")
    procs = []

    def start(*extra: str):
        err = open(tmp_path / f"router-{len(procs)}.err", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0", *served,
                                 *extra], stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        procs.append(proc)
        line = _readline(proc, 20)
        # With --log-format json even the "listening" line is JSON, with the URL as a field.
        url = json.loads(line)["url"] if line.startswith("{") else line.rsplit(" ", 1)[-1].strip()
        return url, err

    yield start
    for proc in procs:
        kill_group(proc)


def _access_lines(err) -> list[dict]:
    err.seek(0)
    return [d for d in (json.loads(line) for line in err.read().splitlines() if line.startswith("{"))
            if d.get("event") == "access"]


def test_router_writes_one_json_access_line_per_request(router_proc):
    url, err = router_proc("--log-format", "json")
    for _ in range(3):
        r = requests.post(url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
    lines = wait_until(lambda: (lambda got: got if len(got) >= 3 else None)(_access_lines(err)), timeout=10,
                       what="three access lines")
    assert len(lines) == 3
    assert {(d["status"], d["model"], d["endpoint"], d["method"], d["path"]) for d in lines} == \
        {(200, MODEL, "log-r1", "POST", "/v1/chat/completions")}
    assert all(d["client"] == "127.0.0.1" and d["duration_ms"] > 0 and d["logger"] == "llmgw.access" for d in lines)


def test_with_json_every_line_the_router_prints_is_json(router_proc):
    url, err = router_proc("--log-format", "json", "--log-level", "debug")
    r = requests.post(url + "/v1/chat/completions", timeout=30, headers={"X-Request-Id": "json-1"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    wait_until(lambda: _access_lines(err), timeout=10, what="the access line")
    err.seek(0)
    lines = [line for line in err.read().splitlines() if line.strip()]
    docs = [json.loads(line) for line in lines]     # every line, not only those that look like JSON
    assert any(d.get("event") == "access" and d["request_id"] == "json-1" and d["tokens_out"] > 0 for d in docs)
    assert any(d["msg"].startswith("router listening on http://") for d in docs)


def test_router_access_log_off(router_proc):
    url, err = router_proc("--log-format", "json", "--no-access-log")
    r = requests.post(url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    # The server logs a line of its own at start: the log works, only access lines are absent.
    wait_until(lambda: "router listening" in (err.seek(0) or err.read()), timeout=10, what="the start line")
    assert _access_lines(err) == []


def test_every_logger_of_ours_is_named_under_llmgw():
    # One prefix, so `llmgw=debug` style filters and log collectors see every
    # piece; `__name__` would give "llmgwctl.agent.core" for some and not others.
    import ast
    from pathlib import Path

    import llmgwctl

    wrong = []
    for path in sorted(Path(llmgwctl.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger" and node.args):
                arg = node.args[0]
                name = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
                if not (isinstance(name, str) and (name == "llmgw" or name.startswith(("llmgw.", "aiohttp.")))):
                    wrong.append(f"{path.name}:{node.lineno}: getLogger({name})")
    assert wrong == []
