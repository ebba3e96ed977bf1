"""Which port a new engine listens on.

Owns the `--ports` range and picking a free port from it. It must not know
about engines or replicas: the caller says which ports its live replicas hold.
"""
from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from .errors import PortRangeError


@dataclass(frozen=True, slots=True)
class PortRange:
    low: int
    high: int   # inclusive, as an operator writes 20000-20999

    @classmethod
    def parse(cls, text: str) -> PortRange:
        low_s, sep, high_s = text.partition("-")
        try:
            low, high = int(low_s), int(high_s if sep else low_s)
        except ValueError:
            raise PortRangeError(f"port range {text!r}: expected LOW-HIGH, e.g. 20000-20999") from None
        if not (1 <= low <= high <= 65535):
            raise PortRangeError(f"port range {text!r}: need 1 <= LOW <= HIGH <= 65535")
        return cls(low, high)

    def __iter__(self) -> Iterator[int]:

        return iter(range(self.low, self.high + 1))

    def __len__(self) -> int:
        return self.high - self.low + 1

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


def bindable(host: str, port: int) -> bool:
    """Whether an engine could listen on host:port right now.

    SO_REUSEADDR mirrors what servers (aiohttp, uvicorn, llama-server) set, so a
    port whose last connection sits in TIME_WAIT counts as free, while a port
    somebody is listening on still does not (Linux refuses that bind).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def pick_port(ports: PortRange, host: str, held: Collection[int], prefer: int | None = None,
              check: Callable[[str, int], bool] = bindable) -> int | None:
    """A port from the range that no live replica holds and that binds now; None if none.

    `prefer` (a restarting replica's previous port) is tried first so its URL
    stays the same across a crash. Scanning from the low end keeps choices
    predictable for an operator reading `ss -ltn`. Blocking (binds sockets):
    call from a worker thread on a running loop.
    """
    candidates = list(ports)
    if prefer is not None and ports.low <= prefer <= ports.high:
        candidates.remove(prefer)
        candidates.insert(0, prefer)
    for port in candidates:
        if port in held:
            continue
        if check(host, port):
            return port
    return None
