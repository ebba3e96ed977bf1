"""The shared asyncio idioms: sleep-unless-woken, and following one file through its directory."""
import asyncio
import os

import pytest

from llmgwctl import aio

from .support import until


async def test_sleep_unless_returns_at_once_for_a_set_event_and_on_the_first_one_set():
    a, b = asyncio.Event(), asyncio.Event()
    b.set()
    assert await aio.sleep_unless(3600, a, b) is True
    b.clear()
    waiting = asyncio.create_task(aio.sleep_unless(3600, a, b))
    await asyncio.sleep(0)
    assert not waiting.done()
    a.set()
    assert await asyncio.wait_for(waiting, 10) is True


async def test_sleep_unless_times_out_false_and_leaves_no_waiter_behind():
    stop = asyncio.Event()
    before = len(asyncio.all_tasks())
    assert await aio.sleep_unless(0.01, stop) is False
    await asyncio.sleep(0)          # a cancelled waiter finishes on the next loop turn
    assert len(asyncio.all_tasks()) == before
    with pytest.raises(ValueError):
        await aio.sleep_unless(None)


async def test_a_cancelled_sleep_unless_cancels_its_waiters():
    stop = asyncio.Event()
    task = asyncio.create_task(aio.sleep_unless(3600, stop))
    await asyncio.sleep(0)
    others = asyncio.all_tasks() - {task, asyncio.current_task()}
    assert others                   # its waiter on `stop`
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert all(t.done() for t in others)


def test_run_returns_what_the_coroutine_returns():
    async def main():
        return 42
    assert aio.run(main()) == 42


async def test_follow_file_sees_creation_a_rename_over_and_removal(tmp_path):
    path = tmp_path / "desired.yaml"
    stop = asyncio.Event()
    seen: list[bool] = []

    async def follow():
        async for _ in aio.follow_file(path, stop):
            seen.append(path.exists())

    task = asyncio.create_task(follow())
    try:
        # Created, rewritten until seen: the watch is armed some time after the
        # follower starts, and an edit before that is no event.
        await until(lambda: seen, "the file's creation", nudge=lambda: path.write_text("a"), every=0.05)
        count = len(seen)
        # Replaced the way editors save: a new file renamed over it.
        tmp = tmp_path / ".desired.yaml.tmp"
        tmp.write_text("b")
        os.replace(tmp, path)
        await until(lambda: len(seen) > count, "the rename over the file")
        count = len(seen)
        path.unlink()
        await until(lambda: len(seen) > count and seen[-1] is False, "the file's removal")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_follow_file_rechecks_without_events_when_asked(tmp_path):
    stop = asyncio.Event()
    wakes = 0

    async def follow():
        nonlocal wakes
        async for _ in aio.follow_file(tmp_path / "never-written", stop, recheck=0.05):
            wakes += 1

    task = asyncio.create_task(follow())
    try:
        await until(lambda: wakes >= 2, "two rechecks with nothing written")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_follow_file_in_a_missing_directory_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        async for _ in aio.follow_file(tmp_path / "no" / "such", asyncio.Event()):
            pass
