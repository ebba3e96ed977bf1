"""The shared asyncio idioms: sleep-unless-woken, long-poll waiters, and following one file through its directory."""
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


async def test_cancel_and_wait_ends_every_task_and_drops_their_outcomes():
    ended: list[str] = []

    async def slow_to_stop(name):
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)       # a cleanup that takes turns of the loop
            ended.append(name)

    async def failed():
        raise RuntimeError("nobody asks for this any more")

    tasks = [asyncio.create_task(slow_to_stop("a")), asyncio.create_task(slow_to_stop("b"))]
    broken = asyncio.create_task(failed())
    finished = asyncio.create_task(asyncio.sleep(0, "done"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert broken.done() and finished.done()
    await aio.cancel_and_wait(*tasks, broken, finished)
    assert sorted(ended) == ["a", "b"]
    assert all(t.cancelled() for t in tasks)
    await aio.cancel_and_wait()             # nothing to take down: returns at once


async def test_cancel_and_wait_lets_the_callers_own_cancellation_through():
    async def stubborn():
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(3600)       # a cleanup that ends only when cancelled again

    helper = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    reached_the_end = False

    async def owner():
        nonlocal reached_the_end
        await aio.cancel_and_wait(helper)
        reached_the_end = True

    caller = asyncio.create_task(owner())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not caller.done()                # waiting for the helper's end
    caller.cancel()                         # reaches the helper's cleanup too
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 10)
    assert caller.cancelled() and not reached_the_end
    assert helper.done() and helper.cancelled()


async def test_waiters_resume_every_waiting_task_in_one_step_of_the_loop():
    waiters = aio.Waiters()
    tasks = [asyncio.create_task(waiters.wait(3600)) for _ in range(3)]
    await asyncio.sleep(0)
    assert len(waiters) == 3 and not any(t.done() for t in tasks)
    waiters.wake()
    # One turn of the loop: each woken task runs before this one does again. An Event
    # waited on through sleep_unless takes three, and a held long-poll's answer would
    # go out turns later, each turn as long as the reports queued meanwhile.
    await asyncio.sleep(0)
    assert all(t.done() and t.result() is True for t in tasks)
    assert len(waiters) == 0


async def test_waiters_time_out_false_wait_anew_after_a_wake_and_clean_up_when_cancelled():
    waiters = aio.Waiters()
    assert await waiters.wait(0.01) is False
    waiters.wake()                  # nobody waiting: nothing kept for the next wait
    late = asyncio.create_task(waiters.wait(3600))
    await asyncio.sleep(0)
    assert not late.done()
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert len(waiters) == 0


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


async def test_sleep_unless_on_a_flag_resumes_in_one_step_of_the_loop():
    flag, stop = aio.Flag(), asyncio.Event()
    sleeper = asyncio.create_task(aio.sleep_unless(3600, flag, stop))
    await asyncio.sleep(0)
    assert not sleeper.done()
    flag.set()
    # One turn: the reconciler's pass starts right after the report that woke it, not
    # three turns later (each as long as the reports queued meanwhile).
    await asyncio.sleep(0)
    assert sleeper.done() and sleeper.result() is True
    assert not flag._futures, "nothing left registered on the flag"


async def test_sleep_unless_on_flags_and_events_times_out_ends_on_either_and_cleans_up():
    flag, event = aio.Flag(), asyncio.Event()
    assert await aio.sleep_unless(0.01, flag, event) is False
    later = asyncio.create_task(aio.sleep_unless(3600, flag, event))
    await asyncio.sleep(0)
    event.set()
    assert await asyncio.wait_for(later, 5) is True
    event.clear()
    cancelled = asyncio.create_task(aio.sleep_unless(3600, flag, event))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not flag._futures
    flag.set()
    assert await aio.sleep_unless(3600, flag, event) is True, "one already set ends it at once"
