"""The console shows a node's scheduling and follows a cordon live: real `llmgwctl serve`, Chromium, Playwright.

Skipped like test_console_browser when Chromium or Playwright is missing
(a failure under LLMGW_REQUIRE_BROWSER=1).
"""
from __future__ import annotations

import requests

from .fleet import Fleet, wait_until
from .test_console_browser import WAIT_MS, browser  # noqa: F401 -- the fixture, shared

ONE = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: fake-one
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def test_the_console_shows_a_cordon_and_an_uncordon_without_a_reload(tmp_path, browser):  # noqa: F811
    from playwright.sync_api import expect

    fleet = Fleet(tmp_path)
    (fleet.catalogs / "one.yaml").write_text(ONE)
    try:
        fleet.start_serve("--settle", "1", "--node", "console-node")
        wait_until(lambda: fleet.ready("fake-one"), "fake-one ready")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(fleet.control + "/")
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        cell = page.locator('#nodes tr[data-node="console-node"] td.scheduling .badge')
        expect(cell).to_have_text("schedulable", timeout=WAIT_MS)
        page.evaluate("window.__same_page = true")
        assert requests.post(f"{fleet.control}/api/v1/nodes/console-node/cordon", json={}, timeout=10).ok
        expect(cell).to_have_text("cordoned", timeout=WAIT_MS)
        expect(cell).to_have_attribute("data-state", "cordoned")
        assert requests.post(f"{fleet.control}/api/v1/nodes/console-node/uncordon", json={}, timeout=10).ok
        expect(cell).to_have_text("schedulable", timeout=WAIT_MS)
        assert page.evaluate("window.__same_page") is True, "the page was reloaded"
        assert errors == []
    finally:
        fleet.close_waiting()
