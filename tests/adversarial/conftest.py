"""Adversarial scenarios use the fault suite's fleet (real serve, agents, fake engines on loopback) and the router suite's engines."""
from tests.faults.conftest import (
    figure,  # noqa: F401 -- a scenario's figure, printed at the end
    fleet,  # noqa: F401 -- the fixture, torn down even on failure
)

# Router scenarios: fake-engine processes and in-process routers, killed and closed even on failure.
from tests.router.conftest import engines, routers  # noqa: F401
