"""`Live`: which catalog is current. The only mutable thing about catalogs.

Readers call `live.current` once per operation and keep that object to the
end, so a swap in the middle of a request is invisible to it rather than a
race. Swapping is one attribute assignment, atomic under the GIL and done on
the event loop by the watcher.
"""
from __future__ import annotations

from collections.abc import Callable

from .model import Catalog

Listener = Callable[[Catalog, Catalog], None]


class Live:
    def __init__(self, catalog: Catalog | None = None):
        self._current = catalog if catalog is not None else Catalog()
        self._listeners: list[Listener] = []

    @property
    def current(self) -> Catalog:
        return self._current

    def subscribe(self, listener: Listener) -> None:
        """Call `listener(old, new)` after every swap (push: once per change, never per request)."""
        self._listeners.append(listener)

    def swap(self, catalog: Catalog) -> Catalog:
        """Make `catalog` current and return the one it replaced."""
        old, self._current = self._current, catalog
        for listener in self._listeners:
            listener(old, catalog)
        return old
