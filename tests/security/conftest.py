"""Fixtures shared with the router tests: real fake-engine processes and routers on loopback."""
from tests.router.conftest import engines, routers  # noqa: F401  (pytest finds fixtures by name)
