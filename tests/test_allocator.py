"""The allocator kit: glibc's heap given back after large buffers, trims rate-limited and off the loop.

- in a fresh interpreter, buffers freed after a large one (which raised
  glibc's creeping mmap threshold past them) stay resident untuned and go
  back at once tuned; a trim gives back what stays either way;
- a threshold the environment sets is left alone;
- the Trimmer trims soon once `threshold` bytes were let go, and after a
  quiet `interval` when fewer were, in its own thread, keeping `interval`
  between trims; bytes let go while a trim waits go with it; off glibc it
  does nothing.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmgwctl import allocator

ROOT = Path(__file__).resolve().parents[1]

needs_glibc = pytest.mark.skipif(allocator.unavailable() is not None, reason=str(allocator.unavailable()))

# What the child prints: its RSS in MiB at the start, with 200 MiB of 1 MiB
# buffers held (and 12.5 MiB of survivors), once they are freed, and after a trim.
CHILD = """
import sys
from llmgwctl import allocator

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) >> 10

if sys.argv[1] == "tune":
    assert allocator.tune()
big = bytes(20 << 20)
del big                          # glibc's threshold, untuned, is now 20 MiB
start = rss()
keep, junk = [], []
for _ in range(200):
    junk.append(b"x" * (1 << 20))
    # A survivor after each, too large for the holes a fresh heap has below
    # (which smaller ones filled, leaving the buffers to merge into the top).
    keep.append(b"y" * (64 << 10))
held = rss()
del junk
freed = rss()
allocator.trim()
print(start, held, freed, rss())
"""


def _child(mode: str) -> tuple[int, ...]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    return tuple(int(v) for v in out.stdout.split())


@needs_glibc
def test_tuned_large_buffers_go_back_when_freed_and_a_trim_gives_back_the_rest():
    start, held, freed, trimmed = _child("plain")
    assert held - start > 150, (start, held)
    # Untuned: the 1 MiB buffers came from the heap, and freeing them gave nothing back...
    assert freed - start > 150, (start, held, freed)
    # ... until a trim did.
    assert trimmed - start < 30, (start, freed, trimmed)
    start, held, freed, trimmed = _child("tune")
    assert held - start > 150, (start, held)
    assert freed - start < 30, (start, held, freed)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _until_trimmed(trimmer: allocator.Trimmer, trims: int) -> None:
    deadline = time.monotonic() + 10
    # Polled, bounded: a trim ends in a done-callback on the loop, with no event of its own to wait on.
    while trimmer.trims < trims and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    assert trimmer.trims == trims


def test_past_the_threshold_a_trim_runs_soon_in_a_thread_of_its_own_and_takes_what_came_while_it_waited():
    clock = Clock()
    threads: list[str] = []

    def fake_trim() -> None:
        threads.append(threading.current_thread().name)

    async def main() -> allocator.Trimmer:
        trimmer = allocator.Trimmer(threshold=10, interval=60.0, settle=0.0, clock=clock, trim_with=fake_trim)
        trimmer.released(4)
        trimmer.released(0)
        # Under the threshold: waits a quiet interval (a minute here: it must not come in this test).
        assert trimmer.scheduled and trimmer.pending == 4 and trimmer.delay(clock.now) == 60.0
        trimmer.released(6)             # past it: brought forward to the settle
        assert trimmer.delay(clock.now) == 0.0
        trimmer.released(50)            # while it waits: goes with it
        await _until_trimmed(trimmer, 1)
        assert trimmer.pending == 0 and not trimmer.scheduled
        trimmer.close()
        return trimmer

    asyncio.run(main())
    assert len(threads) == 1 and threads[0].startswith("llmgw-trim")
    assert threads[0] != threading.current_thread().name


def test_trims_keep_their_interval_and_a_few_bytes_are_trimmed_once_quiet():
    clock = Clock()
    calls: list[float] = []

    async def main() -> None:
        trimmer = allocator.Trimmer(threshold=10, interval=5.0, settle=1.0, clock=clock,
                                    trim_with=lambda: calls.append(clock.now))
        trimmer.pending = 10
        assert trimmer.delay(clock.now) == 1.0     # none yet: only the settle
        trimmer.pending = 0
        trimmer.settle = 0.0
        trimmer.released(10)
        await _until_trimmed(trimmer, 1)
        # The last ended at 100: past the threshold at 102 the next waits 3 s more, at 104.5 half a
        # second, past 105 only the settle; under it, a whole interval from now.
        trimmer.pending = 10
        assert trimmer.delay(102.0) == 3.0 and trimmer.delay(104.5) == 0.5
        trimmer.settle = 1.0
        assert trimmer.delay(110.0) == 1.0
        trimmer.pending = 1
        assert trimmer.delay(102.0) == 5.0 and trimmer.delay(110.0) == 5.0
        trimmer.pending = 0
        # A few bytes and a quiet interval (made short): trimmed all the same.
        trimmer.interval = trimmer.settle = 0.0
        trimmer.released(1)
        await _until_trimmed(trimmer, 2)
        trimmer.interval = 5.0
        trimmer.released(1)
        assert trimmer.scheduled
        trimmer.close()                 # the waiting one (5 s away) never runs, nor any after
        trimmer.released(100)
        assert not trimmer.scheduled

    asyncio.run(main())
    assert calls == [100.0, 100.0]


def test_off_glibc_nothing_is_tuned_counted_or_trimmed(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: "the C library is not glibc (musl)")
    assert allocator.unavailable() == "the C library is not glibc (musl)"
    assert allocator.tune() is False and allocator.trim() is False
    trimmer = allocator.Trimmer(threshold=1)
    assert not trimmer.enabled
    trimmer.released(1 << 30)           # no loop needed: nothing is scheduled
    assert trimmer.pending == 0 and not trimmer.scheduled


@needs_glibc
def test_a_threshold_the_environment_sets_is_left_as_it_is(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576")
    assert allocator.tune() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert allocator.tune() is False
