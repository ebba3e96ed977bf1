"""Which files a catalog directory holds, and reading them within bounds; the cache that spares a reload rereading.

Which files count: `*.yaml` and `*.yml` directly in the directory, following
symlinks only while they stay inside it (Kubernetes ConfigMap mounts are
symlinks into a hidden `..data` directory; a link to /etc/passwd or a token
file is refused unread). Only regular files are read (a FIFO would block the
read for ever, /dev/zero never end it), each up to a size cap, the directory up
to another, and YAML aliases count at their expanded size against a node
budget (a 1 KB alias bomb expands to billions of nodes). See `limits.Limits`.

Hidden names (`.#x.yaml` emacs locks, `.x.yaml.swp` vim swaps) and names
starting with `#` (emacs autosaves) are editors' scratch files and are never
read; `x.yaml~` backups and `x.yaml.tmp` (what `catalog apply` writes
before its rename) fail the suffix test. Subdirectories are not descended into,
so operators can keep drafts or archives beside the catalog.

Owns the filesystem side of a load: listing, the read rules above, and
`FileCache` (by stat, then by content digest). What a file means is for
`yamldoc` and `documents`; this module only hands over bytes.
"""
from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..fsutil import OPEN_FLAGS, file_kind, read_upto
from .documents import FileResult
from .errors import Problem, excerpt
from .limits import too_big

SUFFIXES = (".yaml", ".yml")


def is_catalog_file(name: str) -> bool:
    return name.endswith(SUFFIXES) and not name.startswith((".", "#"))


def catalog_files(directory: str | os.PathLike[str]) -> list[str]:
    """The files of a catalog directory, sorted so errors and merges come in a stable order."""
    with os.scandir(directory) as entries:
        return sorted(os.path.normpath(os.path.join(directory, e.name)) for e in entries if is_catalog_file(e.name))


# A file whose stat says it was modified less than this before it was read may
# still change without its stat changing: the kernel stamps mtime from a
# coarse clock (one tick, 1-10 ms), FAT keeps 2 s, and two same-size writes
# within one stamp look alike (git's "racy" entries). Such a file is read and
# hashed again on every load until it is older than this; then its stat alone
# says it did not change.
RACY_NS = 3_000_000_000
# However long a stat keeps matching, a file is read again after this long:
# a filesystem whose clock lags ours (NFS) or a tool that restores mtime and
# size (rsync -t, `touch -r`) could otherwise keep a changed file unread;
# this bounds how long, at the cost of one read per file in that time.
TRUST_STAT_FOR = 300.0


@dataclass(slots=True)
class _Entry:
    key: tuple[int, ...] | None     # (dev, ino, size, mtime_ns, ctime_ns) of what was read; None: never by stat
    digest: str
    result: FileResult
    trusted_until: float            # monotonic: past it, the file is read again whatever its stat says


class FileCache:
    """Parsed files by path, so a watcher's reload reads and parses only what changed.

    A file whose stat (device, inode, size, mtime and ctime in ns) is the one
    it had when it was read, and that was not racy then (see RACY_NS), is not
    read again: a `git pull` touching one file of 10,000 costs one read, one
    parse and the whole-catalog checks over the union, not 10,000 reads. A
    file that was read again but whose content digest is the same (a `touch`,
    a checkout rewriting it unchanged) is not parsed again. `reads` and
    `parses` count both (and `unchanged` the files taken by their stat), so a test can see what a reload read.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: dict[str, _Entry] = {}
        self._clock = clock
        self.reads = 0          # files opened and read
        self.parses = 0         # files parsed and checked (a read whose digest was new)
        self.unchanged = 0      # files taken by their stat alone

    def by_stat(self, path: str, key: tuple[int, ...]) -> FileResult | None:
        """The cached result of `path` if its stat is still `key` and may be trusted."""
        entry = self._entries.get(path)
        if entry is None or entry.key != key or self._clock() >= entry.trusted_until:
            return None
        self.unchanged += 1
        return entry.result

    def get(self, path: str, digest: str) -> FileResult | None:
        entry = self._entries.get(path)
        return entry.result if entry and entry.digest == digest else None

    def put(self, path: str, digest: str, result: FileResult, key: tuple[int, ...] | None = None) -> None:
        self._entries[path] = _Entry(key, digest, result, self._clock() + TRUST_STAT_FOR)

    def keep_only(self, paths: Iterable[str]) -> None:
        keep = set(paths)
        for path in [p for p in self._entries if p not in keep]:
            del self._entries[path]


def read_file(path: str, root: str | None, max_bytes: int) -> bytes | Problem:
    """A catalog file's bytes, or the Problem of why it is not read.

    Never blocks and never reads more than `max_bytes` + 1: only a regular
    file is opened (checked before and, against a swap, after open), with
    O_NONBLOCK so not even a FIFO put there between the two checks can hold
    the read. When `root` is given, a symlink is followed only if it resolves
    inside it; its target is then not even opened.
    """
    got = read(path, root, max_bytes, None)
    if isinstance(got, Problem):
        return got
    assert got[0] is not None
    return got[0]


def stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read(path: str, root: str | None, max_bytes: int, cache: FileCache | None
          ) -> Problem | tuple[bytes | None, tuple[int, ...] | None, int, FileResult | None]:
    """(bytes, stat key, size, None) of a file read; (None, key, size, result) when `cache` knows it unchanged.

    The stat key is taken from the open file before reading, so a write
    during the read changes the file's stat after it and the next load reads
    it again; it is None (never trusted) when the file was modified within
    RACY_NS of the read.
    """
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            link = os.readlink(path)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return Problem(path, (), f"broken symlink to {excerpt(link, 200)}")
            target = os.path.realpath(path)
            if root is not None and os.path.commonpath([root, target]) != root:
                return Problem(path, (), f"is a symlink to {excerpt(target, 200)}, outside the catalog directory; "
                                         "only links that stay inside it (as a Kubernetes ConfigMap's ..data) "
                                         "are followed")
        if stat.S_ISDIR(st.st_mode):
            return Problem(path, (), "is a directory, not a catalog file")
        if not stat.S_ISREG(st.st_mode):
            return Problem(path, (), f"is {file_kind(st.st_mode)}, not a regular file; only regular files are read")
        if st.st_size > max_bytes:
            return Problem(path, (), too_big(st.st_size, max_bytes, "file"))
        if cache is not None:
            known = cache.by_stat(path, stat_key(st))
            if known is not None:
                return None, stat_key(st), st.st_size, known
        now_ns = time.time_ns()
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        # Deleted between listing and reading (an editor's rename dance); the
        # watcher reloads again on the next event.
        return Problem(path, (), "file disappeared while reading")
    except OSError as exc:
        return Problem(path, (), f"cannot read: {exc.strerror or exc}")
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            return Problem(path, (), "was replaced by something that is not a regular file while reading")
        racy = now_ns - max(opened.st_mtime_ns, opened.st_ctime_ns) < RACY_NS
        key = None if racy else stat_key(opened)
        data = read_upto(fd, max_bytes)
        if cache is not None:
            cache.reads += 1
        return data, key, len(data), None
    except OSError as exc:
        return Problem(path, (), f"cannot read: {exc.strerror or exc}")
    finally:
        os.close(fd)
