"""Per-node revocation: the list's rules, its bounded reader, and the follower that keeps it in force.

What a file can do to the reader it must not do to the control API: a FIFO
renamed over the list opens without blocking and is refused, /dev/zero is
not a regular file, a huge file is refused by size; none of them un-revokes
a node, and an edit after them is in force. The end-to-end revocation
(a real serve refusing one node's token within seconds) is in
test_node_trust.py.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from llmgwctl.control.auth import ControlAuth, TokenError, node_token, parse_revocations
from llmgwctl.control.revocations import RevocationFileError, follow_revocations, load

ADMIN = "admin-" + "1f" * 16
AGENT = "agent-" + "2e" * 16
PATH = "/api/v1/agents/{}/report"


def check(auth: ControlAuth, node: str, token: str):
    return auth.check(PATH.format(node), f"Bearer {token}", node)


def test_a_listed_node_is_refused_below_its_serial_and_no_other_node_is():
    auth = ControlAuth(ADMIN, AGENT)
    old, new = node_token(AGENT, "gpu-7"), node_token(AGENT, "gpu-7", pools=("h100",), serial=2)
    other = node_token(AGENT, "gpu-8")
    auth.revocations = parse_revocations("# stolen 2026-12-01\ngpu-7 2\n")
    refused = check(auth, "gpu-7", old)
    assert refused is not None and refused.status == 401 and "serial 0" in refused.message
    assert "--serial 2" in refused.message
    assert check(auth, "gpu-7", new) is None and check(auth, "gpu-8", other) is None
    auth.revocations = parse_revocations("gpu-7\n")
    assert check(auth, "gpu-7", new).status == 401, "a node listed alone: every token of it"
    assert check(auth, "gpu-7", ADMIN) is None, "the admin token is not a node token"


def test_the_list_names_the_line_of_what_it_cannot_read_and_keeps_the_stricter_of_two():
    with pytest.raises(TokenError, match=r"list:2: the serial 'x' is not a whole number"):
        parse_revocations("a 1\nb x\n", "list")
    with pytest.raises(TokenError, match=r"list:1: expected 'NODE \[SERIAL\]'"):
        parse_revocations("a 1 2\n", "list")
    with pytest.raises(TokenError, match=r"list:1: .*cannot be a node name"):
        parse_revocations("a/b\n", "list")
    assert dict(parse_revocations("a 1\na 3\nb\nb 4\n")) == {"a": 3, "b": None}


def test_the_reader_refuses_what_is_not_a_small_regular_file_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(RevocationFileError, match="not a regular file"):
        load(str(fifo))             # opened O_NONBLOCK: no writer, no hang
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    with pytest.raises(RevocationFileError, match="not a regular file"):
        load(str(zero))
    big = tmp_path / "big"
    big.write_bytes(b"# " + b"x" * (2 * 1024 * 1024) + b"\n")
    with pytest.raises(RevocationFileError, match="more than"):
        load(str(big))
    with pytest.raises(RevocationFileError, match="cannot open"):
        load(str(tmp_path / "missing"))


async def test_the_follower_applies_edits_keeps_the_list_through_bad_files_and_never_unrevokes(tmp_path):
    path = tmp_path / "revoked"
    path.write_text("gpu-7\n")
    auth = ControlAuth(ADMIN, AGENT)
    auth.revocations = load(str(path))
    changes: list[dict] = []
    stop = asyncio.Event()
    task = asyncio.create_task(follow_revocations(auth, str(path), stop, on_change=lambda r: changes.append(dict(r)),
                                                  recheck=0.02))

    async def until(predicate, what: str) -> None:
        for _ in range(500):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    try:
        # A broken list, a FIFO renamed over it, and the file removed: the last list stays in force.
        path.write_text("gpu-7 x\n")
        await asyncio.sleep(0.3)
        os.unlink(path)
        os.mkfifo(path)
        await asyncio.sleep(0.3)
        os.unlink(path)
        await asyncio.sleep(0.3)
        assert dict(auth.revocations) == {"gpu-7": None} and changes == []
        assert not task.done(), "the follower lives on"
        # A valid edit after all that is in force, and told to the controller.
        tmp = tmp_path / ".revoked.tmp"
        tmp.write_text("gpu-7 3\ngpu-9\n")
        os.replace(tmp, path)
        await until(lambda: dict(auth.revocations) == {"gpu-7": 3, "gpu-9": None}, "the edit in force")
        assert changes == [{"gpu-7": 3, "gpu-9": None}]
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
