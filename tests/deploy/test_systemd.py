"""deploy/systemd/*.service held against `systemd-analyze verify` and `systemd-analyze security`.

verify exits 0 on an unknown key or a value it cannot parse (it only warns,
and the unit would run without that line), so any output at all fails here.
It also checks that ExecStart's program exists: the units name
/opt/llmgw/bin/llmgwctl, where deploy/README.md installs llmgw, so the copies
checked here name the llmgwctl of this test run instead, and nothing else in
them differs.
"""
from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .tools import DEPLOY, ROOT, tool

UNITS = ("llmgw-serve.service", "llmgw-agent.service")
INSTALLED = "/opt/llmgw/bin/llmgwctl"
# Exposure scores as `systemd-analyze security` counts them (tenths: 15 is
# "1.5 OK"). serve is tight; the agent gives GPU engines devices, JIT memory
# and the system calls CUDA needs, as its comments explain. A change that
# loosens either past these is a decision to write down, here.
MAX_EXPOSURE = {"llmgw-serve.service": 20, "llmgw-agent.service": 45}


def llmgwctl() -> str:
    found = Path(sys.executable).parent / "llmgwctl"
    return str(found) if found.exists() else shutil.which("llmgwctl") or pytest.skip("llmgwctl is not installed")


@pytest.fixture
def units(tmp_path) -> Path:
    for name in UNITS:
        text = (DEPLOY / "systemd" / name).read_text()
        assert f"ExecStart={INSTALLED} " in text
        (tmp_path / name).write_text(text.replace(INSTALLED, llmgwctl()))
    return tmp_path


def analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("systemd-analyze"), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_units_verify_without_a_single_warning(units):
    out = analyze("verify", "--man=no", *(str(units / n) for n in UNITS), cwd=units)
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_verify_as_run_here_does_report_a_bad_line(units):
    # What the test above relies on: a typo'd key and a bad value do print.
    unit = units / "llmgw-serve.service"
    unit.write_text(unit.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes\nProtectSystem=very"))
    out = analyze("verify", "--man=no", str(unit), cwd=units)
    assert "Unknown key" in out.stderr and "protect system value" in out.stderr, out.stderr


@pytest.mark.parametrize("name", UNITS)
def test_hardening_stays_within_its_exposure_budget(units, name):
    out = analyze("security", "--offline=yes", "--no-pager", f"--threshold={MAX_EXPOSURE[name]}", name, cwd=units)
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout)
    assert out.returncode == 0 and score, out.stdout[-3000:] + out.stderr


def unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str            # systemd keys are case-sensitive
    cp.read_string(re.sub(r"\\\n", " ", (DEPLOY / "systemd" / name).read_text()))
    return cp


@pytest.mark.parametrize("name", UNITS)
def test_units_run_as_the_dedicated_user_with_state_directory_and_sandbox(name):
    svc = unit(name)["Service"]
    assert svc["User"] == "llmgw" and svc["StateDirectory"] == "llmgw"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "CapabilityBoundingSet": ""}.items():
        assert svc.get(key) == value, f"{name}: {key}={svc.get(key)!r}"
    assert "--state-dir %S/llmgw" in svc["ExecStart"] and "%d/" in svc["ExecStart"]
    # The user the units name is the one the sysusers file creates.
    assert re.search(r"^u llmgw ", (DEPLOY / "systemd" / "llmgw.sysusers.conf").read_text(), re.M)


def test_agent_reaches_gpus_and_keeps_its_engines_across_a_restart():
    svc = unit("llmgw-agent.service")["Service"]
    assert svc["PrivateDevices"] == "no" and svc["DevicePolicy"] == "closed"
    text = (DEPLOY / "systemd" / "llmgw-agent.service").read_text()
    assert "DeviceAllow=char-nvidia-frontend rw" in text and "DeviceAllow=char-nvidia-uvm rw" in text
    # Engines outlive the agent by design; control-group would kill them on restart.
    assert svc["KillMode"] == "process"
    # serve stops its own engines in order on SIGTERM; mixed kills what remains.
    assert unit("llmgw-serve.service")["Service"]["KillMode"] == "mixed"


@pytest.mark.parametrize("name", UNITS)
def test_documentation_names_man_pages_the_project_ships(name):
    for page, section in re.findall(r"man:([\w-]+)\((\d)\)", unit(name)["Unit"]["Documentation"]):
        assert (ROOT / "man" / f"{page}.{section}").exists(), page
