"""The fake engine as the members of a replica spanning nodes, as real processes on 127.0.0.1.

A head answers /health 503 until every worker joined its rendezvous and 200
after; a worker that dies takes the head down with a non-zero exit, and a
head that dies takes its workers down; a join that is not one (another
group, a rank taken or out of range, a silent or endless line) is refused
and the head carries on. Every wait is bounded.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests

from llmgwctl.engines.fake_group import BROKEN_CODE, MAX_LINE

from ..procs import free_port, kill_group
from ..support import wait_until

EXIT_TIMEOUT = 30.0   # a member noticing its peer is gone takes one read; this is a loaded machine's start-up


def member(rank: int, size: int, rendezvous: int, *extra: str, port: int | None = None,
           group: str = "g-1") -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "llmgwctl", "engine", "fake", "--model", "m", "--group", group,
            "--group-size", str(size), "--rank", str(rank), "--rendezvous", f"127.0.0.1:{rendezvous}", *extra]
    if port is not None:
        argv += ["--port", str(port)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        kill_group(proc)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


def health(port: int) -> tuple[int, str]:
    resp = requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    return resp.status_code, resp.text


def exited(proc: subprocess.Popen[str]) -> int:
    wait_until(lambda: proc.poll() is not None, f"pid {proc.pid} to exit", timeout=EXIT_TIMEOUT)
    return proc.returncode


def head_waiting(port: int, workers: int) -> None:
    wait_until(lambda: health(port) == (503, f"waiting for {workers} worker(s) to join"),
               f"the head to wait for {workers} worker(s)", errors=(requests.RequestException,))


def whole_group(procs: list[subprocess.Popen[str]], size: int = 2) -> tuple[int, int]:
    """A head and size-1 workers, joined: (the head's API port, its rendezvous port)."""
    api, rendezvous = free_port(), free_port()
    procs.append(member(0, size, rendezvous, port=api))
    head_waiting(api, size - 1)
    for rank in range(1, size):
        procs.append(member(rank, size, rendezvous))
    wait_until(lambda: health(api)[0] == 200, "the head to be whole", errors=(requests.RequestException,))
    return api, rendezvous


def test_the_head_is_503_until_its_workers_joined_then_serves(procs):
    api, rendezvous = free_port(), free_port()
    procs.append(member(0, 3, rendezvous, port=api))
    head_waiting(api, 2)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert requests.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=chat, timeout=5).status_code == 503
    procs.append(member(1, 3, rendezvous))
    head_waiting(api, 1)
    procs.append(member(2, 3, rendezvous))
    wait_until(lambda: health(api)[0] == 200, "the head to be whole", errors=(requests.RequestException,))
    reply = requests.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=chat, timeout=5)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    assert all(p.poll() is None for p in procs)


def test_a_worker_that_dies_takes_the_head_down(procs):
    whole_group(procs)
    head, worker = procs
    kill_group(worker)
    assert exited(head) == BROKEN_CODE
    assert "worker rank 1 left the group" in head.communicate(timeout=5)[1]


def test_a_head_that_dies_takes_its_workers_down(procs):
    whole_group(procs, size=3)
    head, *workers = procs
    kill_group(head)
    for worker in workers:
        assert exited(worker) == BROKEN_CODE
        assert "left the group" in worker.communicate(timeout=5)[1]


def test_a_worker_stopped_by_sigterm_exits_cleanly(procs):
    whole_group(procs)
    head, worker = procs
    worker.send_signal(signal.SIGTERM)
    assert exited(worker) == 0
    # Its head, like a real one, loses a rank: the group is broken either way.
    assert exited(head) == BROKEN_CODE


def test_a_worker_with_no_head_gives_up_after_its_join_timeout(procs):
    procs.append(member(1, 2, free_port(), "--join-timeout", "1"))
    started = time.monotonic()
    assert exited(procs[0]) == BROKEN_CODE
    print(f"worker gave up {time.monotonic() - started:.1f} s after its start (join timeout 1 s)")
    assert "did not welcome rank 1 within 1 s" in procs[0].communicate(timeout=5)[1]


def test_a_head_whose_workers_never_come_exits_after_its_join_timeout(procs):
    procs.append(member(0, 2, free_port(), "--join-timeout", "1", port=free_port()))
    assert exited(procs[0]) == BROKEN_CODE
    assert "1 worker(s) did not join within 1 s" in procs[0].communicate(timeout=5)[1]


def join_line(rendezvous: int, line: bytes) -> bytes:
    """What the head answers `line` with (b"" when it closes without a word)."""
    with socket.create_connection(("127.0.0.1", rendezvous), timeout=10) as s:
        s.sendall(line)
        s.settimeout(10)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = s.recv(MAX_LINE)
            if not chunk:
                break
            answer += chunk
        return answer


def test_joins_that_are_not_a_workers_are_refused_and_the_head_carries_on(procs):
    api, rendezvous = free_port(), free_port()
    procs.append(member(0, 2, rendezvous, port=api))
    head_waiting(api, 1)
    assert join_line(rendezvous, b"GET / HTTP/1.1\r\n") == b"refused: expected 'join GROUP RANK'\n"
    assert join_line(rendezvous, b"join other 1\n") == b"refused: this is group g-1, not other\n"
    assert join_line(rendezvous, b"join g-1 0\n").startswith(b"refused: rank 0 is not a worker's rank")
    assert join_line(rendezvous, b"join g-1 7\n").startswith(b"refused: rank 7 is not a worker's rank")
    assert join_line(rendezvous, b"x" * (4 * MAX_LINE)) == b""      # a line past the bound: dropped unanswered
    head_waiting(api, 1)
    procs.append(member(1, 2, rendezvous))
    wait_until(lambda: health(api)[0] == 200, "the head to be whole", errors=(requests.RequestException,))
    # The rank is taken now; a second claim is refused and the group stays whole.
    assert join_line(rendezvous, b"join g-1 1\n") == b"refused: rank 1 has joined already\n"
    assert health(api)[0] == 200 and procs[0].poll() is None


def test_a_silent_connection_is_not_a_member(procs):
    api, rendezvous = free_port(), free_port()
    procs.append(member(0, 2, rendezvous, port=api))
    head_waiting(api, 1)
    with socket.create_connection(("127.0.0.1", rendezvous), timeout=10) as s:
        s.settimeout(30)
        assert s.recv(MAX_LINE) == b""     # the head hangs up after its hello timeout, without a word
    head_waiting(api, 1)
    assert procs[0].poll() is None


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "2", "--rank", "1", "--group", "g"], "needs --group, --rendezvous"),
    (["--group-size", "2", "--rank", "2", "--group", "g", "--rendezvous", "h:1"], "a --rank below --group-size"),
    (["--group-size", "2", "--rank", "1", "--group", "g", "--rendezvous", "nohost"], "expected HOST:PORT"),
    (["--group-size", "2", "--rank", "0", "--group", "g", "--rendezvous", "h:1"], "--port is required"),
    ([], "--port is required"),
])
def test_member_options_that_cannot_form_a_group_are_usage_errors(argv, message):
    done = subprocess.run([sys.executable, "-m", "llmgwctl", "engine", "fake", "--model", "m", *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr
