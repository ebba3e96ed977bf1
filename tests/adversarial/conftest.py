"""End-to-end adversarial scenarios use the fault suite's fleet (real serve, agents, fake engines on loopback)."""
from tests.faults.conftest import fleet  # noqa: F401 -- the fixture, torn down even on failure
