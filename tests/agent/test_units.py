"""Unit tests of the agent's pure pieces: GPU specs, nvidia-smi output, ports,
backoff, the state file and the pid-reuse guard, desired documents."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from llmgwctl.agent import procs, state
from llmgwctl.agent.backoff import restart_schedule
from llmgwctl.agent.desired import DesiredFile, parse_document
from llmgwctl.agent.errors import DesiredError, GpuSpecError, PortRangeError
from llmgwctl.agent.gpus import parse_nvidia_smi, parse_spec
from llmgwctl.agent.ports import PortRange, bindable, pick_port
from llmgwctl.contracts import ReplicaSpec

from ..support import FakeClock

# -- GPU specs -----------------------------------------------------------------

def test_spec_single_kind():
    gpus = parse_spec("4xH100-80GB", node="n1")
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert {g.name for g in gpus} == {"H100-80GB"}
    assert {g.memory_mib for g in gpus} == {80 * 1024}
    assert len({g.uuid for g in gpus}) == 4
    assert all(g.uuid.startswith("GPU-") for g in gpus)


def test_spec_mixed_kinds_keep_order_and_count():
    gpus = parse_spec("2xA100-80GB, 1xL4-24GB")
    assert [(g.index, g.name, g.memory_mib) for g in gpus] == [
        (0, "A100-80GB", 81920), (1, "A100-80GB", 81920), (2, "L4-24GB", 24576)]


def test_spec_free_memory_defaults_to_the_total_and_may_be_given():
    assert [g.memory_free_mib for g in parse_spec("2xL4-24GB")] == [24576, 24576]
    gpus = parse_spec("1xL4-24GB:16GB,1xH100-80GB")
    assert [(g.name, g.memory_mib, g.memory_free_mib) for g in gpus] == [
        ("L4-24GB", 24576, 16384), ("H100-80GB", 81920, 81920)]
    with pytest.raises(GpuSpecError, match="COUNTxNAME-MEMGB"):
        parse_spec("1xL4-24GB:30GB")          # more free than it has


def test_spec_uuids_are_deterministic_per_node():
    assert parse_spec("2xA100-80GB", "a") == parse_spec("2xA100-80GB", "a")
    assert parse_spec("2xA100-80GB", "a")[0].uuid != parse_spec("2xA100-80GB", "b")[0].uuid


@pytest.mark.parametrize("bad", ["", "H100", "4H100-80GB", "4xH100", "0xH100-80GB", "4xH100-0GB",
                                 "2xA100-80GB,", "ax-80GB", "4 x -80GB"])
def test_spec_errors_name_the_expected_form(bad):
    with pytest.raises(GpuSpecError, match=r"COUNTxNAME-MEMGB.*4xH100-80GB"):
        parse_spec(bad)


def test_cli_turns_a_bad_spec_into_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from llmgwctl.cli import main
    result = CliRunner().invoke(main, ["agent", "--gpus", "4xH100", "--state-dir", str(tmp_path),
                                       "--desired", str(tmp_path / "d.yaml")])
    assert result.exit_code == 2
    assert "--gpus" in result.output and "COUNTxNAME-MEMGB" in result.output


def test_cli_needs_a_controller_or_a_desired_file(tmp_path):
    from click.testing import CliRunner

    from llmgwctl.cli import main
    result = CliRunner().invoke(main, ["agent", "--gpus", "none", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--controller" in result.output and "--desired" in result.output


# -- nvidia-smi ------------------------------------------------------------------

# Recorded from a DGX H100 (trimmed to three GPUs) and an L4 box; the second
# name carries a comma to check names are taken from the middle.
NVIDIA_SMI = """\
0, GPU-5f0c1b2e-7a3d-4c1e-9b8a-0d2f3e4a5b6c, NVIDIA H100 80GB HBM3, 81559, 81000
1, GPU-6a1d2c3f-8b4e-5d2f-ac9b-1e3f4a5b6c7d, NVIDIA H100 80GB HBM3, 81559, 40000
2, GPU-7b2e3d4a-9c5f-6e3a-bdac-2f4a5b6c7d8e, NVIDIA H100 80GB HBM3, 81559, 81000
"""


def test_nvidia_smi_csv():
    gpus = parse_nvidia_smi(NVIDIA_SMI)
    assert [g.index for g in gpus] == [0, 1, 2]
    assert gpus[0].uuid == "GPU-5f0c1b2e-7a3d-4c1e-9b8a-0d2f3e4a5b6c"
    assert gpus[2].name == "NVIDIA H100 80GB HBM3"
    assert gpus[1].memory_mib == 81559
    # Free memory is read beside the total: placement fits profiles' gpu_memory into it.
    assert [g.memory_free_mib for g in gpus] == [81000, 40000, 81000]


def test_nvidia_smi_name_with_comma_and_unsorted_lines():
    gpus = parse_nvidia_smi("1, GPU-b, Odd, Name, 24576, 24000\n\n0, GPU-a, NVIDIA L4, 23034, 23000\n")
    assert [(g.index, g.name) for g in gpus] == [(0, "NVIDIA L4"), (1, "Odd, Name")]


@pytest.mark.parametrize("bad", ["0, GPU-a, 80GB, 1", "x, GPU-a, H100, 81559, 81000", "0, GPU-a, H100, 81559, [N/A]",
                                 "0, GPU-a, H100, 81559"])
def test_nvidia_smi_garbage_names_the_line(bad):
    with pytest.raises(ValueError, match="nvidia-smi line 1"):
        parse_nvidia_smi(bad)


def test_auto_without_nvidia_smi_is_no_gpus(monkeypatch, caplog):
    from llmgwctl.agent.gpus import discover
    monkeypatch.setenv("PATH", "/nonexistent")
    with caplog.at_level("INFO"):
        assert discover("auto") == ()
    assert "nvidia-smi not found" in caplog.text
    assert discover("none") == ()


# -- ports -------------------------------------------------------------------------

def test_port_range_parse():
    assert PortRange.parse("20000-20999") == PortRange(20000, 20999)
    assert len(PortRange.parse("20000-20999")) == 1000
    assert PortRange.parse("8000") == PortRange(8000, 8000)
    for bad in ("a-b", "20-10", "0-10", "1-70000", "-"):
        with pytest.raises(PortRangeError, match=bad.split("-")[0] or "port range"):
            PortRange.parse(bad)


def test_pick_port_skips_held_and_unbindable():
    busy = {20001}
    check = lambda host, port: port not in busy   # noqa: E731 -- stands in for the kernel's answer
    rng = PortRange(20000, 20003)
    assert pick_port(rng, "127.0.0.1", held=set(), check=check) == 20000
    assert pick_port(rng, "127.0.0.1", held={20000}, check=check) == 20002
    assert pick_port(rng, "127.0.0.1", held={20000, 20002, 20003}, check=check) is None
    # A restarting replica gets its old port back when it is still free...
    assert pick_port(rng, "127.0.0.1", held={20000}, prefer=20003, check=check) == 20003
    # ...but never one another live replica holds, nor one outside the range.
    assert pick_port(rng, "127.0.0.1", held={20003}, prefer=20003, check=check) == 20000
    assert pick_port(rng, "127.0.0.1", held=set(), prefer=9, check=check) == 20000


def test_bindable_sees_a_real_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not bindable("127.0.0.1", port)
        assert pick_port(PortRange(port, port), "127.0.0.1", held=set()) is None
    assert bindable("127.0.0.1", port)


# -- backoff ---------------------------------------------------------------------------

def test_backoff_doubles_to_the_cap():
    b = restart_schedule(FakeClock())
    assert [b.failure() for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_backoff_resets_only_after_staying_ready_long_enough():
    clock = FakeClock()
    b = restart_schedule(clock)     # 1 s doubling to 60 s, reset after 300 s ready, not jittered
    assert [b.failure() for _ in range(3)] == [1, 2, 4]
    b.ready()
    clock.advance(299)         # crashed again a little too soon: keeps growing
    assert b.failure() == 8
    b.ready()
    clock.advance(300)         # ran long enough: the next crash is a fresh start
    assert b.failure() == 1
    assert b.failure() == 2  # and no ready in between: growing again


# -- state file and process identity ---------------------------------------------------

def _record(pid: int, started: int, rid: str = "r1") -> state.Record:
    spec = ReplicaSpec(id=rid, model="m", profile="p", engine="fake", source="m", gpus=1, args=("--x", "1"),
                       env={"A": "b"}, gpu_indices=(1,))
    return state.Record(spec=spec, pid=pid, start_time=started, pgid=pid, port=20001, restarts=2)


def test_state_round_trip(tmp_path):
    recs = [_record(123, 456), _record(124, 457, "r2")]
    state.save(tmp_path, "boot-a", recs)
    assert state.load(tmp_path, "boot-a") == recs
    assert state.load(tmp_path, "boot-a")[0].spec.spec_hash == recs[0].spec.spec_hash
    assert [p.name for p in tmp_path.iterdir()] == ["replicas.json"]   # no temp file left behind


def test_state_from_another_boot_is_ignored(tmp_path):
    state.save(tmp_path, "boot-a", [_record(123, 456)])
    assert state.load(tmp_path, "boot-b") == []


def test_unreadable_state_is_set_aside_not_lost(tmp_path):
    (tmp_path / "replicas.json").write_text('{"format": 1, "replicas": [{"oops"')
    assert state.load(tmp_path, "boot-a") == []
    assert (tmp_path / "replicas.json.bad-0").read_text().startswith('{"format": 1')


def test_missing_state_is_empty(tmp_path):
    assert state.load(tmp_path / "nowhere", "boot-a") == []


def test_pid_reuse_guard():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        started = procs.start_time(proc.pid)
        assert started is not None
        assert procs.is_same_process(proc.pid, started)
        # Same pid, another start time: what a reused pid looks like. Never ours.
        assert not procs.is_same_process(proc.pid, started + 1)
        assert not procs.group_is_ours(proc.pid, started + 1)
        assert procs.group_is_ours(proc.pid, started)
        assert procs.group_members(proc.pid) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert not procs.is_same_process(proc.pid, started)
    assert procs.group_members(proc.pid) == []


def test_own_start_time_matches_proc_stat_field_22():
    raw = open(f"/proc/{os.getpid()}/stat").read()
    assert procs.start_time(os.getpid()) == int(raw.rsplit(")", 1)[1].split()[19])


def test_log_rotation_and_tail(tmp_path):
    log = tmp_path / "r.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    assert procs.tail(log, 3) == ["line 997", "line 998", "line 999"]
    assert not procs.rotate_log(log, cap=1 << 20)
    assert procs.rotate_log(log, cap=100)
    assert log.stat().st_size == 0
    assert (tmp_path / "r.log.1").read_bytes().endswith(b"line 999\n")
    assert procs.tail(tmp_path / "none.log") == []


# -- desired documents -----------------------------------------------------------------

def test_desired_minimal_entries():
    specs = parse_document("replicas:\n - {id: a, model: m, engine: fake, gpus: 1}\n"
                           " - {id: b, model: m, engine: fake, gpu_indices: [0, 1], args: [--x], env: {K: v}}\n",
                           "d.yaml")
    assert [s.id for s in specs] == ["a", "b"]
    assert specs[1].gpus == 2 and specs[1].gpu_indices == (0, 1) and dict(specs[1].env) == {"K": "v"}


def test_desired_json_and_to_dict_round_trip():
    spec = _record(1, 1).spec
    assert parse_document(json.dumps({"replicas": [spec.to_dict()]}), "d.json") == (spec,)


@pytest.mark.parametrize("text, message", [
    ("replicas: [{id: a, model: m}]", r"replicas\[0\]: missing engine"),
    ("replicas: [{id: a, model: m, engine: fake}, {id: a, model: n, engine: fake}]", "used twice"),
    ("replicas: {id: a}", "must be a list"),
    ("- a\n- b", "expected a mapping"),
    ("replicas: [", "not valid YAML"),
    ("replicas: [{id: a, model: m, engine: fake, gpus: 2, gpu_indices: [0]}]", "gpus is 2"),
])
def test_desired_errors_name_file_and_entry(text, message):
    with pytest.raises(DesiredError, match=message) as err:
        parse_document(text, "d.yaml")
    assert str(err.value).startswith("d.yaml")


def test_desired_file_keeps_the_last_good_list(tmp_path):
    path = tmp_path / "d.yaml"
    follow = DesiredFile(path)
    assert follow.poll() is None and "cannot read" in follow.last_error
    path.write_text("replicas: [{id: a, model: m, engine: fake}]")
    assert [s.id for s in follow.poll()] == ["a"]
    assert follow.poll() is None            # unchanged: nothing new
    path.write_text("replicas: [{id: a}]  # broken on purpose")
    assert follow.poll() is None and "missing" in follow.last_error
    path.write_text("replicas: []")
    assert follow.poll() == () and follow.last_error is None
