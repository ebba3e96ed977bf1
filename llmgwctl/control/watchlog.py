"""What each endpoint-watch version told the routers, so a router can be told only what changed since its own.

A watch answer used to be the whole endpoint list every time: at 20,000
endpoints that is ~4 MB to each of 50 routers for every replica that turns
ready, and the routers fell behind the changes (at 5,000 nodes, by tens of
seconds: bench/README.md, "Figures behind the comments"). A router that
asks with `delta=1` and the version it holds is answered with the endpoints
added or changed since then and the ids removed; when this controller does
not know that version (too old, or handed out by an earlier controller
process) the answer is the whole list, as for a router that does not ask.

It keeps, per version it answered, the endpoint tuple and catalog version it
answered with -- references to the reconciler's immutable tuples, no
copies -- for the last HISTORY versions. It knows no HTTP: the control API
feeds it and encodes what it returns.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..contracts import Endpoint

# Versions remembered. A version is bumped per pass that changed endpoints,
# model states or the catalog; a router polls again as soon as it applied an
# answer, so it is rarely more than a version or two behind. 32 covers a
# router that was slow for a burst of passes; one further behind gets the
# whole list once, which is what it would have had anyway.
HISTORY = 32


@dataclass(frozen=True, slots=True)
class Delta:
    """From the state a router held at `since` to the current one."""

    since: int
    changed: tuple[Endpoint, ...]       # new, or differing from the one of the same replica id
    removed: tuple[str, ...]            # replica ids no longer listed
    catalog_changed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"since"
: self.since, "endpoints": [e.to_dict() for e in self.changed], "removed": list(self.removed)}


class WatchLog:
    def __init__(self, keep: int = HISTORY) -> None:
        self.keep = keep
        # version -> (endpoints, catalog version) answered with it; None when two
        # different states were answered under one version (no delta from it then).
        self._states: collections.OrderedDict[int, tuple[Sequence[Endpoint], str] | None] = collections.OrderedDict()

    def answered(self, version: int, endpoints: Sequence[Endpoint], catalog_version: str) -> None:
        """`version` was answered with these endpoints and this catalog."""
        known = self._states.get(version, ...)
        if known is ...:
            self._states[version] = (endpoints, catalog_version)
            while len(self._states) > self.keep:
                self._states.popitem(last=False)
        elif known is not None and (known[0] is not endpoints or known[1] != catalog_version):
            self._states[version] = None

    def delta(self, since: int, endpoints: Sequence[Endpoint], catalog_version: str) -> Delta | None:
        """What changed from the state answered with `since` to this one; None when that state is not known."""
        held = self._states.get(since)
        if held is None:
            return None
        old_endpoints, old_catalog = held
        if old_endpoints is endpoints:
            return Delta(since, (), (), old_catalog != catalog_version)
        old = {e.replica_id: e for e in old_endpoints}
        changed = []
        for e in endpoints:
            was = old.pop(e.replica_id, None)
            if was is not e and was != e:
                changed.append(e)
        return Delta(since, tuple(changed), tuple(sorted(old)), old_catalog != catalog_version)
