"""Hostile clients' bodies leave the router's loop free while they are handled.

- a body of megabytes with few commas (a 30 MB `model` string, a body of
  padding) is parsed off the loop: the C parser reads a long string at a few
  ms per MB, and the comma count alone let such a body be parsed on the loop;
- a gzip body inflating to megabytes is inflated, once known to fit, with the
  loop taking turns meanwhile (it was inflated whole in one go on the loop);
- and counted in the executor it is given, past one step of output or a
  small compressed size (a body of thousands of empty gzip members inflates
  to nothing and still costs a walk of them all); only a small body that
  inflates to less than a step is decoded on the loop;
- a name too long to be any model's comes back from the worker cut, with its
  length, and is refused quoting its true length.

Ordering, not timing: a ticker task on the same loop must get turns after
the counting pass and before the body is ready.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import json
from collections.abc import Callable
from typing import Any

from llmgwctl import httpbody
from llmgwctl.router import errors, jsonbody


def test_a_body_of_megabytes_without_commas_is_parsed_off_the_loop():
    name_body = b'{"model": "' + b"m" * (3 << 20) + b'", "messages": []}'
    pad_body = b'{"model":"good","messages":[],"pad":"' + b" " * (3 << 20) + b'"}'
    assert name_body.count(b",") < jsonbody.ON_LOOP_COMMAS
    assert jsonbody.heavy(name_body) and jsonbody.heavy(pad_body)
    # An ordinary request stays on the loop, and so does a long prompt below the bound.
    small = json.dumps({"model": "good", "messages": [{"role": "user", "content": "hi " * 100_000}]}).encode()
    assert not jsonbody.heavy(small)
    assert not jsonbody.heavy(b'{"model":"good"}')


def test_an_inflating_body_leaves_the_loop_turns_after_it_is_known_to_fit():
    raw = b'{"model":"good","messages":[],"pad":"' + b" " * (16 << 20) + b'"}'
    data = gzip.compress(raw, 6)
    turns: list[str] = []

    async def main() -> bytes:
        done = False

        async def ticker() -> None:
            while not done:
                turns.append("tick")
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        try:
            return await httpbody.decode(data, "gzip", 32 << 20, admit=lambda size: turns.append("admitted"))
        finally:
            done = True
            await task

    out = asyncio.run(main())
    assert out == raw
    # The counting pass takes turns with the loop, and so must the pass that keeps the body.
    assert "tick" in turns[turns.index("admitted") + 1:], turns[-5:]


class Recording(concurrent.futures.ThreadPoolExecutor):
    """A one-thread executor that keeps the names of what it was given."""

    def __init__(self) -> None:
        super().__init__(1)
        self.ran: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.ran.append(fn.__name__)
        return super().submit(fn, *args, **kwargs)


def _decode(data: bytes, limit: int = 32 << 20) -> tuple[bytes | Exception, list[str]]:
    executor = Recording()

    async def main() -> bytes:
        return await httpbody.decode(data, "gzip", limit, executor=executor)

    try:
        try:
            return asyncio.run(main()), executor.ran
        except httpbody.BodyError as exc:
            return exc, executor.ran
    finally:
        executor.shutdown()


def test_a_small_compressed_body_is_inflated_on_the_loop_as_before():
    raw = json.dumps({"model": "good", "messages": []}).encode()
    assert asyncio.run(httpbody.decode(gzip.compress(raw), "gzip", 1 << 20)) == raw
    assert _decode(gzip.compress(raw)) == (raw, [])


def test_the_count_past_one_step_and_of_a_large_compressed_body_runs_in_the_executor():
    raw = b'{"model":"good","pad":"' + b" " * (4 << 20) + b'"}'
    assert _decode(gzip.compress(raw)) == (raw, ["_count", "_inflated"])
    # A bomb: counted off the loop, refused there, never kept.
    got, ran = _decode(gzip.compress(b" " * (64 << 20)))
    assert isinstance(got, httpbody.BodyTooLarge) and ran == ["_count"]
    # Thousands of empty members: nothing comes out, and walking them is off the loop too.
    members = gzip.compress(b"", 1) * 5000
    assert len(members) > httpbody.ON_LOOP_INPUT
    assert _decode(members + gzip.compress(b"{}")) == (b"{}", ["_count", "_inflated"])
    # An empty member is a whole one, not a truncated stream (it was refused as one).
    assert _decode(gzip.compress(b"")) == (b"", [])


def test_a_too_long_name_parsed_off_the_loop_comes_back_cut_and_keeps_its_length():
    body = b'{"model": "' + b"q" * (3 << 20) + b'", "messages": []}'
    facts = jsonbody._parse_off_loop(body, "model", None, 64)
    assert isinstance(facts, jsonbody.Facts)
    assert len(facts.model) == errors.MAX_NAME_CHARS + 1 and facts.model_chars == 3 << 20
    message = json.loads(errors.name_too_long(facts.model, facts.model_chars).body)["error"]["message"]
    assert f"({3 << 20} characters)" in message and "q" * 101 not in message


def _spawned_children() -> list[int]:
    """This process's children that are body parser workers."""
    import os
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"jsonbody.worker_main" in f.read():
                        kids.append(int(entry))
    return kids


def test_the_body_parser_worker_yields_the_cpu_to_the_router():
    # Where no core is spare, a client's million-value body must wait for
    # the router's loop, not the other way round: the worker runs niced.
    import os
    before = set(_spawned_children())

    async def main() -> int:
        worker = jsonbody.OffLoop()
        try:
            body = b'{"model":"good","messages":[],' + b",".join(b'"k%d":0' % i for i in range(60_000)) + b"}"
            facts = await worker.parse(body, "model", None, 64)
            assert facts.model == "good" and facts.off_loop
            (pid,) = set(_spawned_children()) - before
            return os.getpriority(os.PRIO_PROCESS, pid)
        finally:
            await worker.aclose()

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert asyncio.run(main()) == min(19, mine + jsonbody.WORKER_NICENESS)


def test_the_worker_parses_bodies_in_turn_and_comes_back_after_it_is_killed():
    import os
    import signal

    async def main() -> None:
        worker = jsonbody.OffLoop()
        try:
            bodies = [b'{"model":"m%d","pad":"%s"}' % (i, b" " * (3 << 20)) for i in range(4)]
            got = await asyncio.gather(*(worker.parse(b, "model", None, 64) for b in bodies))
            assert [f.model for f in got] == ["m0", "m1", "m2", "m3"]
            # A refusal crosses back as the router's own exception.
            try:
                await worker.parse(b"[" + b" " * (3 << 20) + b"1]", "model", None, 64)
            except jsonbody.BodyRefused as exc:
                assert exc.code == "invalid_body"
            else:
                raise AssertionError("a JSON array was not refused")
            (pid,) = _spawned_children()
            os.kill(pid, signal.SIGKILL)
            for _ in range(100):        # bounded: the kill lands within moments
                if not _spawned_children() or _spawned_children() != [pid]:
                    break
                await asyncio.sleep(0.05)
            try:
                facts = await worker.parse(bodies[0], "model", None, 64)
            except jsonbody.WorkerBusy:
                facts = await worker.parse(bodies[0], "model", None, 64)     # the one that met the dead worker
            assert facts.model == "m0" and _spawned_children() != [pid]
        finally:
            await worker.aclose()

    asyncio.run(main())
