"""The node's allowance for catalog-defined engines: a name pinned to one program, nothing else runs."""
from __future__ import annotations

import os
import stat

import pytest

from llmgwctl.contracts import ReplicaSpec
from llmgwctl.engines import (
    AllowedEngines,
    EngineNotAllowed,
    SpecNotAllowed,
    TemplateDriver,
    UnknownEngine,
    available_engines,
    driver_for,
)


def spec(engine: str = "mylmdeploy", command=("lmdeploy", "serve", "{source}", "--port", "{port}"), **kw) -> ReplicaSpec:
    return ReplicaSpec(id="r", model="m", profile="p", engine=engine, source="org/m", gpus=0, command=tuple(command),
                       **kw)


def executable(directory, name):
    path = directory / name
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def lmdeploy(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    return executable(tmp_path, "lmdeploy")


def test_by_default_no_catalog_engine_gets_a_driver():
    with pytest.raises(EngineNotAllowed, match=r"catalog engine 'mylmdeploy' is not allowed on this node.*"
                                               r"llmgwctl agent --allow-engine mylmdeploy=lmdeploy"):
        driver_for(spec())
    assert issubclass(EngineNotAllowed, UnknownEngine)       # the agent's "nothing a retry changes"


def test_a_shell_command_is_refused_like_any_other():
    with pytest.raises(EngineNotAllowed, match="allow-engine shelly=sh"):
        driver_for(spec("shelly", ("sh", "-c", "touch /tmp/x")))


def test_a_built_in_name_runs_its_driver_whatever_command_the_spec_carries():
    assert driver_for(spec("fake", ("sh", "-c", "touch /tmp/x"))).name == "fake"


def test_an_allowed_engine_runs_its_pinned_program_by_its_resolved_path(lmdeploy):
    allowed = AllowedEngines.parse(["mylmdeploy=lmdeploy"])
    driver = driver_for(spec(), allowed)
    assert isinstance(driver, TemplateDriver)
    argv = driver.launch(spec(), host="127.0.0.1", port=20001).argv
    assert argv == (str(lmdeploy), "serve", "org/m", "--port", "20001")
    # The catalog may name the same file by its path; the node's PATH decides, not a profile's env
    # (which may not set PATH at all: the agent refuses such a spec before any lookup).
    by_path = spec(command=(str(lmdeploy), "serve", "{source}"))
    assert driver_for(by_path, allowed).launch(by_path, host="127.0.0.1", port=1).argv[0] == str(lmdeploy)
    with pytest.raises(SpecNotAllowed, match="PATH"):
        driver_for(spec(command=(str(lmdeploy), "serve", "{source}"), env={"PATH": "/tmp/elsewhere"}), allowed)


def test_an_allowed_name_with_another_program_is_refused(lmdeploy):
    allowed = AllowedEngines.parse([f"mylmdeploy={lmdeploy}"])
    with pytest.raises(EngineNotAllowed, match=r"runs 'sh', but this node allows 'mylmdeploy' only as "):
        driver_for(spec(command=("sh", "-c", "touch /tmp/x")), allowed)
    with pytest.raises(EngineNotAllowed, match="is not allowed"):
        driver_for(spec("other"), allowed)


def test_an_allowed_engine_whose_program_is_missing_is_reported_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    allowed = AllowedEngines.parse(["mylmdeploy=lmdeploy"])
    ok, why = driver_for(spec(), allowed).available()
    assert not ok and "lmdeploy" in why
    found = available_engines(allowed=allowed)
    assert found["mylmdeploy"][0] is False and "not found on PATH" in found["mylmdeploy"][1]
    assert found["fake"] == (True, "built in")


def test_available_engines_names_each_allowed_engine(lmdeploy):
    found = available_engines(allowed=AllowedEngines.parse(["mylmdeploy=lmdeploy"]))
    assert found["mylmdeploy"] == (True, f"lmdeploy at {lmdeploy} (allowed on this node)")
    assert "mylmdeploy" not in available_engines()


@pytest.mark.parametrize("value, message", [
    ("mylmdeploy", "give NAME=PROGRAM"),
    ("mylmdeploy=", "give NAME=PROGRAM"),
    ("My Engine=x", "not an engine name"),
    ("fake=/bin/true", "built in"),
    ("x=bin/lmdeploy", "absolute path"),
])
def test_a_bad_allowance_is_refused_with_why(value, message):
    with pytest.raises(ValueError, match=message):
        AllowedEngines.parse([value])


def test_one_program_per_engine():
    with pytest.raises(ValueError, match="already allowed as a"):
        AllowedEngines.parse(["x=a", "x=b"])
    assert AllowedEngines.parse(["x=a", "x=a"]).pins == {"x": "a"}
