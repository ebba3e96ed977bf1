"""The fault suite's figures: one line per scenario, printed as it happens and again in pytest's summary.

pytest captures a passing test's stdout, so each figure is also kept here and
written through the terminal reporter at the end of the session: every line
shows in the CI log whether the scenario passed or failed.
"""
from __future__ import annotations

import pytest

from tests.e2e.fleet import Fleet

FIGURES: list[str] = []


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
        fleet.close()
        assert fleet.marked_pids() == [], "processes left behind"


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("fault suite figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
