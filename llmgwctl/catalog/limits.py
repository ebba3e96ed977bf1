"""What one catalog load may cost: the `Limits`, the deadline that enforces the last of them, the paused collector.

Owns the bounds every part of a load checks (bytes, YAML nodes, models,
depth, seconds) and how a load keeps within them on a shared interpreter. It
knows nothing of files or YAML: the readers and parsers check against it.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """What one load may cost; the defaults hold real catalogs with room to spare.

    Validating costs per YAML node (composing, the schema, building models
    and the whole-catalog rules are all in Python), and a load's worst case is
    what its node budget allows: the defaults are set so that the costliest
    shape within them (tens of thousands of one-line models) validates in a
    few seconds on a 2-core machine, `bench/catalog_limits.py` measures each
    shape and bench/README.md has its figures. A real model is 30-50 nodes, so
    the budget is ~5,000 of them in one catalog, past any fleet one gateway
    serves; a bigger catalog is split across gateways, not loaded in one.
    """

    # A file's bytes bound the read and the scan before anything parses; 2 MiB
    # holds more than the node budget does in real models (~260 bytes for ~40
    # nodes), so a file never meets this before its nodes, unless it is
    # mostly comments or one huge string.
    max_file_bytes: int = 2 << 20
    # Four files at the cap; what the directory's bytes cost beyond its nodes
    # (reading, decoding, scanning) stays well under a second.
    max_dir_bytes: int = 8 << 20
    # YAML nodes per load (directory-wide), each alias counted at the size of
    # what it repeats, so an alias bomb is refused before it is expanded.
    max_nodes: int = 200_000
    # Models in the whole catalog. A model costs more than its nodes (it is
    # built, checked, hashed into the version, and placement and every
    # reconcile pass walk it), so one-line models would make the node budget
    # 25,000 of them; 10,000 is still past any fleet one gateway serves.
    max_models: int = 10_000
    # A catalog is 6 levels deep (models[i].profiles[j].env.KEY); libyaml's
    # composer recurses on the C stack and segfaults near 100,000 levels.
    max_depth: int = 64
    # The last guard, for a machine too loaded for the limits above to mean
    # anything: a load gives up after this long and says so, rather than
    # keep a thread working on the interpreter the router shares. Below the
    # watcher's LOAD_TIMEOUT (30 s), so the loader stops first, with its own reason.
    max_seconds: float | None = 25.0


DEFAULT_LIMITS = Limits()


def mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB"


def too_big(size: int, limit: int, what: str) -> str:
    return f"{what} is larger than {mib(limit)} ({size} bytes or more); no catalog file is that big"


class Deadline:
    """When a load gives up: checked between files and, inside one, every few thousand nodes.

    A load within the Limits takes a few seconds at most; one that takes many
    times that runs on a machine too loaded to say anything useful, and
    giving up stops the work (a thread left running would keep taking the
    interpreter from the router) instead of finishing an answer nobody waits for.
    """

    __slots__ = ("at", "seconds", "hit")

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds
        self.hit = False

    def passed(self) -> bool:
        if self.at is not None and time.monotonic() > self.at:
            self.hit = True
        return self.hit

    def message(self) -> str:
        return (f"validating the catalog took longer than {self.seconds or 0:g} s (the most a load within the "
                "catalog's limits should take many times over); not read further. Is the machine overloaded?")


NO_DEADLINE = Deadline(None)
_collector_lock = threading.Lock()
_collector_holders = 0
_collector_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a load runs, on again (if it was) when the last load ends.

    A load allocates an object or more per YAML node and keeps most of them
    until it ends, so the collector's young passes promote them and its full
    passes walk them all -- with the interpreter held, from the loading
    thread, which stalls the event loop sharing the process (the router) for
    as long as one full pass takes, and made up a third of a big load's time.
    What a load allocates holds no cycles worth collecting meanwhile, and a
    load is bounded (Limits), so collecting after it loses nothing.
    """
    global _collector_holders, _collector_was_enabled
    with _collector_lock:
        if _collector_holders == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_holders += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_holders -= 1
            if _collector_holders == 0 and _collector_was_enabled:
                gc.enable()
