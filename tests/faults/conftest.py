"""The fault suite: each scenario drives load while something breaks, then checks what clients saw.

Every scenario starts its own fleet of real processes on 127.0.0.1 (the e2e
`Fleet`: controller, agents, fake engines, standalone routers), torn down
even on failure. Run it with `python -m pytest tests/faults -q`.

Each scenario prints one figure line (requests sent, failed, recovered in N
s). pytest captures a passing test's stdout, so the figures are also kept
here and written through the terminal reporter at the end of the session:
every line shows in the CI log whether the scenario passed or failed.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.fleet import Fleet

FIGURES: list[str] = []
# A scenario takes 5-25 s on a loaded 2-core machine; 60 s cuts a hung one
# (its fleet is still torn down) and keeps the suite of ten under 10 minutes
# whatever happens.
SCENARIO_TIMEOUT = 60


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SCENARIO_TIMEOUT))


@pytest.fixture
def figure(request):
    """`figure("sent 412, failed 0, ...")`: print the scenario's one-line figure and keep it for the summary."""
    def emit(text: str) -> None:
        line = f"{request.node.name}: {text}"
        print(line, flush=True)
        FIGURES.append(line)
    return emit


@pytest.fixture
def fleet(tmp_path):
    """A fresh fleet per scenario, torn down (engines included) even when the scenario fails."""
    fleet = Fleet(tmp_path / "fleet")
    try:
        yield fleet
    finally:
        fleet.close_checked()


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("fault suite figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
