"""The C heap of a process that handles large buffers: memory it lets go of goes back to the kernel.

Why. A router holds request bodies of up to tens of MB and whole answers of
up to 64 MiB, each for one request. glibc's malloc keeps what is freed for
reuse rather than give it back, and two of its habits kept serve's memory
high after a burst of large bodies (issue 27: +139 MB, never returned):

- its mmap threshold creeps up. A buffer above the threshold gets a mapping
  of its own, unmapped when freed; but each such buffer freed raises the
  threshold to its size (up to 32 MiB on 64-bit), so after one 16 MiB body
  is let go, every later buffer under 16 MiB -- the next bodies, their
  bytearrays growing, an answer joined from its chunks -- comes from the
  heap, and stays there in pieces between the small objects that outlive it;
- free memory inside a heap, below its top, goes back only through
  `malloc_trim`, which glibc never calls on its own for it.

So, at process start, `tune()` fixes M_MMAP_THRESHOLD (setting it also turns
the creeping off), and a `Trimmer` calls `malloc_trim(0)` (every arena, free
pages below the top too) soon after large buffers of at least `threshold`
bytes were let go since the last trim, and after a quiet `interval` when
fewer were: in a thread of its own, as a trim walks the heap's free lists;
at most once per `interval`, so a flood of large bodies costs one trim every
few seconds, not one per body.

Off glibc (musl, macOS, Windows) neither call exists: `tune()` and the
`Trimmer` do nothing, and `unavailable()` says why. It imports nothing of ours.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import logging
import os
import platform
import time
from collections.abc import Callable
from functools import cache

log = logging.getLogger("llmgw.allocator")

# mallopt's parameter number for the threshold (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3

# Buffers of 512 KiB and more get mappings of their own, given back whole when
# freed. Not lower: asyncio reads a socket into a fresh 256 KiB bytes object
# (shrunk to what arrived), and above the threshold each read would cost an
# mmap, an mremap and a munmap (measured: a socket's send+recv of 300 bytes,
# 17-20 us at 512 KiB, 27-32 us at 256 KiB, as with glibc's own starting
# 128 KiB). Not higher: what lies below the threshold fragments the heap
# until the next trim.
MMAP_THRESHOLD = 512 << 10

# A trim soon once 32 MiB of large buffers were let go since the last: one
# body at the default size limit, or two 16 MiB answers. Less waits a quiet
# interval: not worth a walk of the heap while more may come.
TRIM_AFTER_BYTES = 32 << 20
# At most one trim per 5 s: a trim of a heap of a few hundred MB takes
# milliseconds of a core, in a thread, so a flood costs well under 1 % of one.
TRIM_INTERVAL = 5.0
# A buffer is counted as let go when the request that held it ends, a moment
# before its last reference (the server's request object, a response being
# written) is dropped: the trim waits this long for them.
TRIM_SETTLE = 1.0


@cache
def _libc() -> ctypes.CDLL | str:
    """glibc, loaded; or why not."""
    name, version = platform.libc_ver()
    if name != "glibc":
        return f"the C library is not glibc ({name or 'unknown'}), whose mallopt and malloc_trim these are"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError as exc:
        return f"glibc {version} could not be loaded: {exc}"
    for symbol in ("mallopt", "malloc_trim"):
        if not hasattr(libc, symbol):
            return f"glibc {version} has no {symbol}"
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def unavailable() -> str | None:
    """Why this process's allocator cannot be tuned or trimmed; None when it can (glibc)."""
    libc = _libc()
    return libc if isinstance(libc, str) else None


def tune(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `mmap_threshold` bytes (see the module docstring); whether it was set.

    Call once, at the start of a process that handles large buffers, before
    its threads start. Off glibc, a no-op (False, logged at debug with the
    reason); so too when the environment already sets the threshold
    (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in
    GLIBC_TUNABLES): an operator's choice stands.
    """
    libc = _libc()
    if isinstance(libc, str):
        log.debug("allocator not tuned: %s", libc)
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        log.debug("allocator not tuned: the environment sets glibc's mmap threshold")
        return False
    # mallopt answers 1 on success, 0 on a value it refuses.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold))


def trim() -> bool:
    """Give the kernel the free pages of every heap now (`malloc_trim(0)`); whether any went back.

    Blocking (it walks the free lists, without the GIL), so called in a thread
    by `Trimmer`; off glibc, False.
    """
    libc = _libc()
    if isinstance(libc, str):
        return False
    return bool(libc.malloc_trim(0))


class Trimmer:
    """Trims the heap after large buffers were let go, at most once per `interval`, off the loop.

    `released(nbytes)` is called on the loop when a request lets go of large
    buffers (its body, a whole answer); it costs an addition and, at most, a
    timer. Once `threshold` bytes were let go since the last trim, one is
    due `settle` seconds on (or later, to keep `interval` between trims);
    fewer wait `interval` (so the last bodies of a burst, too few to pass the
    threshold, are given back too, once things are quiet). A trim runs in a
    thread of the trimmer's own. Bytes let go while a trim waits go with it;
    while one runs, towards the next. `trim_with` is the call made, by
    default glibc's `malloc_trim(0)`; off glibc there is none, and nothing is
    ever counted or trimmed.
    """

    def __init__(self, *, threshold: int = TRIM_AFTER_BYTES, interval: float = TRIM_INTERVAL,
                 settle: float = TRIM_SETTLE, clock: Callable[[], float] = time.monotonic,
                 trim_with: Callable[[], object] | None = None):
        self.threshold = threshold
        self.interval = interval
        self.settle = settle
        self._clock = clock
        self._trim = trim_with if trim_with is not None else (trim if unavailable() is None else None)
        self.pending = 0            # bytes let go since the last trim began
        self.trims = 0              # trims finished
        self._last: float | None = None     # when the last trim ended
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0             # when the waiting trim runs, on `clock`
        self._running = False
        self._closed = False
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    @property
    def scheduled(self) -> bool:
        """Whether a trim is waiting or running."""
        return self._timer is not None or self._running

    def delay(self, now: float) -> float:
        """How long from `now` a trim of what is pending waits (see the class docstring)."""
        gap = self.settle if self._last is None else max(self.settle, self._last + self.interval - now)
        return gap if self.pending >= self.threshold else max(gap, self.interval)

    def released(self, nbytes: int) -> None:
        """Large buffers of `nbytes` bytes in all were let go (call on the loop)."""
        if self._trim is None or self._closed or nbytes <= 0:
            return
        self.pending += nbytes
        if not self._running:
            self._arm()

    def _arm(self) -> None:
        """A timer for the trim of what is pending; moved earlier if it became due sooner."""
        now = self._clock()
        due = now + self.delay(now)
        if self._timer is not None:
            if due >= self._due:
                return
            self._timer.cancel()
        self._due = due
        self._timer = asyncio.get_running_loop().call_later(due - now, self._start)

    def _start(self) -> None:
        self._timer = None
        trim = self._trim
        if trim is None:
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmgw-trim")
        self.pending = 0
        try:
            future = asyncio.get_running_loop().run_in_executor(self._worker, trim)
        except RuntimeError:
            return          # shutting down: no thread to be had, and no trim needed
        self._running = True
        future.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[object]) -> None:
        self._running = False
        self._last = self._clock()
        self.trims += 1
        if not future.cancelled() and future.exception() is not None:
            log.warning("malloc_trim failed: %s", future.exception())
        if self.pending and not self._closed:
            self._arm()     # let go of while it ran

    def close(self) -> None:
        """Cancel a waiting trim and let the thread go (a running trim ends on its own); no more trims."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=False, cancel_futures=True)
