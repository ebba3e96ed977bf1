"""YAML read within bounds, the parts every reader of an untrusted YAML file shares.

    LOADER      the safe loader, libyaml's when it is installed (about ten times faster on big files)
    NodeCount   a document's size and depth counted event by event, before anything is composed

The catalog loader and the router's key and endpoint files each turn what
NodeCount finds into their own message and limits. This module imports
nothing of ours, so any piece may use it.
"""
from __future__ import annotations

from typing import Any, cast

import yaml

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class NodeCount:
    """Counts a YAML document's nodes as the event parser yields them, each alias at the size of what it names.

    The event parser keeps its own stack, so neither a deep nesting (which
    crashes libyaml's composer) nor an alias bomb (9 aliases of 9 aliases...
    is billions of nodes) costs more than the events up to where the
    caller's bound runs out: an alias adds the size of what it names without
    expanding it.
    """

    __slots__ = ("nodes", "_sizes", "_stack")

    def __init__(self) -> None:
        self.nodes = 0
        self._sizes: dict[str, int] = {}
        self._stack: list[tuple[int, str | None]] = []

    @property
    def depth(self) -> int:
        """How many collections the last event is inside of (itself included, for a collection's start)."""
        return len(self._stack)

    def add(self, event: Any) -> str | None:
        """Count `event`; the alias's name if it refers to a node that contains it (a recursive document), else None."""
        if isinstance(event, yaml.AliasEvent):
            # An alias always names its anchor (the scanner refuses a bare
            # `*`); only the stubs' shared NodeEvent type allows None.
            alias = cast(str, event.anchor)
            if any(anchor == alias for _, anchor in self._stack):
                return alias
            self.nodes += self._sizes.get(alias, 1)
        elif isinstance(event, yaml.ScalarEvent):
            self.nodes += 1
            if event.anchor:
                self._sizes[event.anchor] = 1
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self.nodes += 1
            self._stack.append((self.nodes - 1, event.anchor))
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            start, anchor = self._stack.pop()
            if anchor:
                self._sizes[anchor] = self.nodes - start
        return None
