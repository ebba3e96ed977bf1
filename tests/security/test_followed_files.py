"""Every file llmgw follows is read like the catalog: what sits at its path cannot hang, stall or blind llmgw.

Against a real `llmgwctl router` and a real `llmgwctl serve`: a FIFO renamed
over the API key file, a link to /dev/zero, a 30 MB file, a directory, the
file deleted or made unreadable. After each, the router and the control API
answer (each request bounded by its own timeout), the keys in force stay,
the problem is shown (status' `watchers`, `llmgwctl status`, the
llmgw_watcher_* metrics), and a revocation written next is in force within
seconds: the revoked key gets 401. The static endpoint file, read by the
same reader, takes the same attacks.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from llmgwctl.fsutil import MissingFile, UnusableFile, read_regular
from llmgwctl.router.auth import KeyFileError, hash_key, load_keys
from tests.procs import kill_group
from tests.router.harness import _readline, static_router_args, wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "ff-qwen"
PROM = "sk-prometheus-" + "p" * 32          # a key with no models: it reads /metrics through every step
# How long a revocation may take to be in force: "within seconds", with room for a loaded 2-core machine.
REVOKED_WITHIN = 20.0
# One request to a router or control API that is not stalled answers well within this.
ANSWERS_WITHIN = 5.0


def keys_yaml(*keys: str) -> str:
    lines = ["keys:", f"  - {{name: prometheus, sha256: {hash_key(PROM)}, models: [], rpm: 100000}}"]
    lines += [f"  - {{name: k{i}, sha256: {hash_key(k)}, models: ['*'], rpm: 100000}}" for i, k in enumerate(keys)]
    return "\n".join(lines) + "\n"


def clear(path: Path) -> None:
    """Whatever a previous attack left at `path` (a directory too), gone."""
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


def rename_into(path: Path, make: Callable[[Path], None]) -> None:
    """Make the thing beside `path` and rename it over, as a deploy would."""
    tmp = path.with_name("." + path.name + ".new")
    clear(tmp)
    make(tmp)
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    os.replace(tmp, path)


def put_text(path: Path, text: str) -> None:
    rename_into(path, lambda p: p.write_text(text))


def big_file(p: Path) -> None:
    with open(p, "w") as f:
        line = "# " + "x" * 1021 + "\n"
        for _ in range(30 * 1024):
            f.write(line)


def unreadable(p: Path) -> None:
    p.write_text("keys: []\n")
    os.chmod(p, 0)


def as_directory(path: Path) -> None:
    clear(path)
    path.mkdir()


ATTACKS: list[tuple[str, Callable[[Path], None], str]] = [
    ("a FIFO renamed over it", lambda path: rename_into(path, lambda p: os.mkfifo(p)), "FIFO"),
    ("a symlink to /dev/zero", lambda path: rename_into(path, lambda p: os.symlink("/dev/zero", p)), "a device"),
    ("a 30 MB file", lambda path: rename_into(path, big_file), "more than the 4 MiB"),
    ("a directory", as_directory, "a directory"),
    ("the file deleted", clear, "does not exist"),
    ("a symlink to nothing", lambda path: rename_into(path, lambda p: os.symlink(str(path) + ".gone", p)),
     "does not exist"),
]
if os.geteuid() != 0:      # root reads a file whatever its mode
    ATTACKS.append(("the file made unreadable", lambda path: rename_into(path, unreadable), "Permission denied"))


def answers(url: str) -> int:
    """The status of GET `url`, which must come within ANSWERS_WITHIN: a stalled loop fails the test here."""
    return requests.get(url, timeout=ANSWERS_WITHIN).status_code


def models(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.get(url + "/v1/models", headers=headers, timeout=ANSWERS_WITHIN).status_code


def metric(url: str, name: str, watcher: str, key: str | None = None) -> float | None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = requests.get(url + "/metrics", headers=headers, timeout=ANSWERS_WITHIN).text
    found = re.search(rf'^{name}{{watcher="{watcher}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


class Router:
    """A real `llmgwctl router` process with its stderr (its log) in a file."""

    def __init__(self, tmp_path: Path, args: list[str]):
        self.log = tmp_path / "router.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0",
                                          *args, "--log-level", "info"], stdout=subprocess.PIPE, stderr=err,
                                         text=True, start_new_session=True)
        self.url = _readline(self.proc, 30).rsplit(" ", 1)[-1].strip()

    def logged(self, words: str) -> bool:
        return words in self.log.read_text(errors="replace")

    def close(self) -> None:
        kill_group(self.proc)


# -- the reader -------------------------------------------------------------------------

@pytest.mark.parametrize("make, words", [
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    (lambda p: os.symlink("/dev/zero", p), "is a device, not a regular file"),
    (lambda p: p.mkdir(), "is a directory, not a regular file"),
    (lambda p: p.write_bytes(b"x" * 2048), "is 2048 bytes, more than the"),
])
def test_the_reader_refuses_what_is_not_a_small_regular_file_without_opening_it(tmp_path, make, words):
    path = tmp_path / "keys.yaml"
    make(path)
    with pytest.raises(UnusableFile, match=re.escape(words)):
        read_regular(path, 1024, "key file")


def test_the_reader_names_a_missing_file_and_a_link_to_nothing(tmp_path):
    with pytest.raises(MissingFile, match="does not exist"):
        read_regular(tmp_path / "nope.yaml", 1024)
    os.symlink(tmp_path / "gone", tmp_path / "link.yaml")
    with pytest.raises(MissingFile, match="is a symlink to .*gone.*which does not exist"):
        read_regular(tmp_path / "link.yaml", 1024)
    # A link to a regular file is followed: Kubernetes mounts Secrets as links.
    (tmp_path / "real.yaml").write_text("keys: []\n")
    os.symlink(tmp_path / "real.yaml", tmp_path / "mounted.yaml")
    assert read_regular(tmp_path / "mounted.yaml", 1024) == b"keys: []\n"


def test_a_30_mb_key_file_is_refused_unparsed(tmp_path):
    path = tmp_path / "keys.yaml"
    big_file(path)
    with pytest.raises(KeyFileError, match="more than the 4 MiB allowed for the API key file; not read"):
        load_keys(path)


def test_an_alias_bomb_or_a_deep_nesting_in_a_key_file_is_refused_before_it_is_built(tmp_path):
    path = tmp_path / "keys.yaml"
    bomb = ['a0: &a0 ["k","k","k","k","k","k","k","k","k"]'] + [
        f"a{i}: &a{i} [" + ",".join(f"*a{i - 1}" for _ in range(9)) + "]" for i in range(1, 10)]
    path.write_text("\n".join(bomb) + "\nkeys: *a9\n")
    with pytest.raises(KeyFileError, match="YAML nodes"):
        load_keys(path)
    path.write_text("keys: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(KeyFileError, match="nested more than"):
        load_keys(path)


# -- the API key file, in a standalone router ----------------------------------------------

def test_the_key_file_survives_every_attack_and_the_next_revocation_takes(tmp_path, engines):
    engine = engines(MODEL, "ff-r1")
    served = static_router_args(tmp_path, MODEL, engine.url, "ff-r1")
    path = tmp_path / "keys.yaml"
    current = "sk-step-0-" + "0" * 32
    path.write_text(keys_yaml(current))
    router = Router(tmp_path, [*served, "--api-keys", str(path)])
    try:
        assert models(router.url, current) == 200 and models(router.url, None) == 401
        assert metric(router.url, "llmgw_watcher_degraded", "api-keys", PROM) == 0.0
        for step, (name, attack, words) in enumerate(ATTACKS, start=1):
            attack(path)
            wait_until(lambda: metric(router.url, "llmgw_watcher_degraded", "api-keys", PROM) == 1.0,
                       timeout=REVOKED_WITHIN, what=f"{name}: the key file shown degraded")
            assert answers(router.url + "/healthz") == 200, name
            assert models(router.url, current) == 200, f"{name}: the keys in force must stay"
            assert router.logged(words), f"{name}: the log must say why ({words!r})"
            # The revocation: the key in force leaves the file, a new one comes.
            revoked, current = current, f"sk-step-{step}-" + str(step % 10) * 32
            put_text(path, keys_yaml(current))
            wait_until(lambda revoked=revoked: models(router.url, revoked) == 401, timeout=REVOKED_WITHIN,
                       what=f"after {name}: the revoked key refused")
            assert models(router.url, current) == 200, name
            assert metric(router.url, "llmgw_watcher_degraded", "api-keys", PROM) == 0.0, name
        failures = metric(router.url, "llmgw_watcher_failures_total", "api-keys", PROM)
        assert failures is not None and failures >= len(ATTACKS)
        # Revoking every key at once.
        put_text(path, "keys: []\n")
        wait_until(lambda: models(router.url, current) == 401, timeout=REVOKED_WITHIN, what="keys: [] in force")
        assert router.proc.poll() is None
    finally:
        router.close()


def test_a_key_file_linked_in_from_another_directory_is_followed_when_the_link_moves(tmp_path, engines):
    """A Kubernetes Secret: keys.yaml -> ..data/keys.yaml, and an update re-points ..data; no event names keys.yaml."""
    engine = engines(MODEL, "ff-k8s")
    served = static_router_args(tmp_path, MODEL, engine.url, "ff-k8s")
    mount = tmp_path / "secret"
    (mount / "..v1").mkdir(parents=True)
    first, second = "sk-v1-" + "1" * 32, "sk-v2-" + "2" * 32
    (mount / "..v1" / "keys.yaml").write_text(keys_yaml(first))
    os.symlink("..v1", mount / "..data")
    os.symlink("..data/keys.yaml", mount / "keys.yaml")
    router = Router(tmp_path, [*served, "--api-keys", str(mount / "keys.yaml")])
    try:
        assert models(router.url, first) == 200
        (mount / "..v2").mkdir()
        (mount / "..v2" / "keys.yaml").write_text(keys_yaml(second))
        os.symlink("..v2", mount / "..data_tmp")
        os.replace(mount / "..data_tmp", mount / "..data")
        wait_until(lambda: models(router.url, first) == 401, timeout=REVOKED_WITHIN, what="the old key revoked")
        assert models(router.url, second) == 200
    finally:
        router.close()


# -- the API key file, in serve: the control API and `llmgwctl status` ------------------------

def _cli_status(control: str) -> str:
    result = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", control],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_serve_shows_a_broken_key_file_in_status_and_takes_the_next_revocation(tmp_path):
    from tests.e2e.fleet import Fleet

    fleet = Fleet(tmp_path / "fleet")
    (fleet.catalogs / "m.yaml").write_text(
        f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: {MODEL}\n    source: org/m\n"
        "    profiles: [{name: default, engine: fake, gpus: 0}]\n")
    path = tmp_path / "keys.yaml"
    current = "sk-serve-0-" + "0" * 32
    path.write_text(keys_yaml(current))
    try:
        fleet.start_controller("--api-keys", str(path))
        wait_until(lambda: models(fleet.router, current) == 200, timeout=60, what="the router with its keys")
        row = {w["name"]: w for w in fleet.status()["watchers"]}
        assert row["api-keys"]["state"] == "ok" and row["catalog"]["state"] == "ok"
        for step, (name, attack, words) in enumerate(ATTACKS[:3], start=1):    # FIFO, /dev/zero, 30 MB
            attack(path)

            def shown(words=words):
                row = {w["name"]: w for w in fleet.status()["watchers"]}["api-keys"]
                return row["state"] == "degraded" and words in (row["problem"] or "")
            wait_until(shown, timeout=REVOKED_WITHIN, what=f"{name} shown in status")
            assert answers(fleet.control + "/healthz") == 200 and answers(fleet.router + "/healthz") == 200
            assert models(fleet.router, current) == 200, f"{name}: the keys in force must stay"
            text = " ".join(_cli_status(fleet.control).split())     # the problem is wrapped to the terminal
            assert "api-keys file DEGRADED" in text and words in text, text
            assert 'llmgw_watcher_degraded{watcher="api-keys"} 1.0' in \
                requests.get(fleet.control + "/metrics", timeout=ANSWERS_WITHIN).text
            revoked, current = current, f"sk-serve-{step}-" + str(step) * 32
            put_text(path, keys_yaml(current))
            wait_until(lambda revoked=revoked: models(fleet.router, revoked) == 401, timeout=REVOKED_WITHIN,
                       what=f"after {name}: the revoked key refused")
            assert models(fleet.router, current) == 200
            row = {w["name"]: w for w in fleet.status()["watchers"]}["api-keys"]
            assert row["state"] == "ok" and row["failures"] == step, row
            assert "DEGRADED" not in _cli_status(fleet.control)
        assert fleet.controller is not None and fleet.controller.poll() is None
    finally:
        fleet.close()


# -- the static endpoint file ---------------------------------------------------------------

def endpoint_replicas(url: str) -> set[str]:
    text = requests.get(url + "/metrics", timeout=ANSWERS_WITHIN).text
    return set(re.findall(r'^llmgw_router_endpoint_info\{[^}]*replica="([^"]+)"', text, re.M))


def chat(url: str) -> int:
    return requests.post(url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code


def test_the_endpoint_file_survives_the_same_attacks_and_the_next_edit_takes(tmp_path, engines):
    engine = engines(MODEL, "ff-e0")
    served = static_router_args(tmp_path, MODEL, engine.url, "ff-e0")
    path = tmp_path / "eps.yaml"
    router = Router(tmp_path, served)
    try:
        assert chat(router.url) == 200 and endpoint_replicas(router.url) == {"ff-e0"}
        for step, (name, attack, words) in enumerate(ATTACKS, start=1):
            attack(path)
            wait_until(lambda: metric(router.url, "llmgw_watcher_degraded", "endpoints") == 1.0,
                       timeout=REVOKED_WITHIN, what=f"{name}: the endpoint file shown degraded")
            assert answers(router.url + "/healthz") == 200, name
            assert chat(router.url) == 200, f"{name}: the endpoints in force must stay"
            assert router.logged(words), f"{name}: the log must say why ({words!r})"
            put_text(path, f"endpoints:\n  - {{model: {MODEL}, url: '{engine.url}', id: ff-e{step}}}\n")
            wait_until(lambda step=step: endpoint_replicas(router.url) == {f"ff-e{step}"}, timeout=REVOKED_WITHIN,
                       what=f"after {name}: the next edit in force")
            assert metric(router.url, "llmgw_watcher_degraded", "endpoints") == 0.0
            assert chat(router.url) == 200
        assert metric(router.url, "llmgw_watcher_degraded", "catalog") == 0.0
        assert router.proc.poll() is None
    finally:
        router.close()


# -- the agent's --desired file -------------------------------------------------------------

@pytest.mark.parametrize("make, words", [
    (lambda p: os.mkfifo(p), "FIFO"),
    (lambda p: os.symlink("/dev/zero", p), "a device"),
])
def test_the_agents_desired_file_is_refused_not_waited_on(tmp_path, make, words):
    import threading

    from llmgwctl.agent.desired import DesiredFile

    path = tmp_path / "desired.yaml"
    make(path)
    follow = DesiredFile(path)
    box: list = []
    reader = threading.Thread(target=lambda: box.append(follow.poll()), daemon=True)
    reader.start()
    reader.join(ANSWERS_WITHIN)         # a FIFO would hold the read for ever, /dev/zero never end it
    assert box == [None], "poll() did not return"
    assert words in (follow.last_error or "")


# -- supervision, in process ----------------------------------------------------------------

async def test_a_hung_read_is_given_up_shown_and_the_file_followed_on(tmp_path):
    """A read that hangs (a dead NFS server) is bounded; no second thread piles up behind it; a bug is survived."""
    import asyncio
    import threading

    from llmgwctl.fsutil import FollowedFile
    from tests.support import until

    path = tmp_path / "f.yaml"
    path.write_text("one")
    release, applied, calls = threading.Event(), [], []

    def parse(data: bytes) -> str:
        calls.append(data)
        if data == b"hang":
            release.wait(30)
        if data == b"bug":
            raise ZeroDivisionError("a bug in parsing")
        return data.decode()

    follower = FollowedFile(path, name="test", what="test file", parse=parse, apply=applied.append,
                            rejects=ValueError, max_bytes=100, recheck=0.05, read_timeout=0.5)
    follower.load_initial()
    stop = asyncio.Event()
    task = follower.start(stop)
    try:
        put_text(path, "hang")
        await until(lambda: follower.problem and "took longer than" in follower.problem, "the hung read given up")
        await until(lambda: follower.problem and "earlier read has not finished" in follower.problem,
                    "the next look not piling up behind it")
        assert calls.count(b"hang") == 1
        release.set()
        put_text(path, "bug")
        await until(lambda: follower.problem and "ZeroDivisionError" in follower.problem, "the bug shown")
        put_text(path, "two")
        await until(lambda: applied[-1:] == ["two"], "the next edit in force")
        assert follower.status()["state"] == "ok" and follower.failures >= 3 and not task.done()
    finally:
        release.set()
        stop.set()
        await asyncio.wait_for(task, 10)
