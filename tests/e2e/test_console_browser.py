"""The web console in a real browser: Debian's Chromium, driven by Playwright, against a real `llmgwctl serve`.

What a person at the page sees: a replica that turns ready appears without a
reload (the status stream), a rejected edit shows every error with its
file:line:col, catalog text stays text (no markup from a catalog runs), the
page reads at a phone's width, with a token the page asks for it, and a
replica's LoRA adapters show with the engine's reason for one that failed.
Screenshots are kept (under $LLMGW_ARTIFACTS, else the test's tmp_path) and
their paths printed.

Skipped when Chromium or Playwright is missing, unless LLMGW_REQUIRE_BROWSER=1
(CI sets it, and .ci/run installs Chromium), where that is a failure.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from .fleet import Fleet, wait_until

CHROMIUM = os.environ.get("LLMGW_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Headless and quiet: no sandbox (CI runs as root), no GPU, no network of its own.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Any wait on the page: generous for two shared cores, never reached when it works.
WAIT_MS = 60_000

ONE = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: fake-one
    aliases: [default]
    profiles: [{name: cpu, engine: fake, gpus: 0, env: {NOTE: "<img src=x onerror=window.__xss=1>"}}]
"""
TWO = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: fake-two
    profiles: [{name: h100, engine: fake, gpus: 1, args: ["--startup-delay", "1"]}]
  - name: crashy
    profiles: [{name: cpu, engine: fake, gpus: 0, args: ["--crash-after", "0.2"]}]
"""
BAD = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: fake-bad
    profiles: [{engine: "<b id=injected>vlm</b>", gpus: 0}]
"""


def _need_browser():
    required = os.environ.get("LLMGW_REQUIRE_BROWSER") == "1"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if required:
            pytest.fail("LLMGW_REQUIRE_BROWSER=1 but Playwright is not installed (pip install -e '.[test]')")
        pytest.skip("Playwright is not installed (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        if required:
            pytest.fail(f"LLMGW_REQUIRE_BROWSER=1 but there is no Chromium at {CHROMIUM} (apt-get install chromium)")
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")


@pytest.fixture
def artifacts(tmp_path) -> Path:
    where = Path(os.environ.get("LLMGW_ARTIFACTS") or tmp_path) / "console"
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture
def browser():
    _need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


def _shot(page, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
    print(f"console screenshot: {path}")


def test_console_follows_the_fleet_live_and_shows_a_rejected_edit(tmp_path, browser, artifacts):
    from playwright.sync_api import expect

    fleet = Fleet(tmp_path)
    (fleet.catalogs / "one.yaml").write_text(ONE)
    try:
        # Two simulated GPUs (the fake engine takes any), so the page has GPUs and memory to show.
        fleet.start_serve("--settle", "1", "--gpus", "2xH100-80GB")
        wait_until(lambda: fleet.ready("fake-one"), "fake-one ready")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(fleet.control + "/")
        assert page.url.endswith("/ui/")
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        expect(page.locator('#replicas tr[data-state="ready"]', has_text="fake-one")).to_have_count(1, timeout=WAIT_MS)
        expect(page.locator("#nodes tbody tr")).to_have_count(1, timeout=WAIT_MS)
        # The page is not reloaded from here on: this mark would be gone.
        page.evaluate("window.__same_page = true")

        # A new model: its replica shows up and turns ready, pushed by the stream.
        (fleet.catalogs / "two.yaml").write_text(TWO)
        expect(page.locator('#replicas tr[data-state="ready"]', has_text="fake-two")).to_have_count(1, timeout=WAIT_MS)
        expect(page.locator("#models tr[data-model=fake-two]")).to_contain_text("1 / 1")
        # Profiles come from the catalog in force, fetched when its version changed.
        expect(page.locator("#models tr[data-model=fake-two]")).to_contain_text("h100: fake, 1 GPU,")
        two = page.locator("#replicas tr", has_text="fake-two").get_attribute("data-replica")
        # A crashed engine: its exit code and its own last words, on the page.
        crashed = page.locator("#replicas tr", has_text="crashy")
        expect(crashed.locator("pre.log")).to_contain_text("CUDA out of memory", timeout=WAIT_MS)
        expect(crashed.locator('td[data-label="Last exit"]')).to_have_text("3")
        crashed.locator("details summary").click()
        node = page.locator("#nodes tbody tr")
        expect(node).to_contain_text("1 / 2 used")
        expect(node).to_contain_text(f"GPU 0 H100-80GB · 80 GiB · {two}")
        expect(node).to_contain_text("GPU 1 H100-80GB · 80 GiB · free")

        # A rejected edit: every error with its file:line:col, as text.
        bad = fleet.catalogs / "bad.yaml"
        bad.write_text(BAD)
        rejection = page.locator("#rejection")
        expect(rejection).to_be_visible(timeout=WAIT_MS)
        expect(rejection.locator("li", has_text=f"{bad}:5:25: models[0].profiles[0].engine:")).to_have_count(1)
        expect(rejection).to_contain_text("<b id=injected>vlm</b>")
        assert page.locator("#injected").count() == 0, "markup from the catalog was parsed as HTML"
        expect(page.locator("#catalog-json")).to_contain_text("<img src=x onerror=window.__xss=1>")
        assert page.evaluate("window.__xss") is None, "catalog content ran as script"
        assert page.evaluate("window.__same_page") is True, "the page was reloaded"
        _shot(page, artifacts / "console-desktop.png")

        # A phone's width: rows become cards, nothing wider than the screen.
        page.set_viewport_size({"width": 390, "height": 844})
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the page is {width}px wide at a 390px viewport"
        assert page.locator("#replicas thead").is_hidden()
        _shot(page, artifacts / "console-phone.png")
        assert errors == [], errors
    finally:
        fleet.close()


def test_console_asks_for_the_token_and_healthz_stays_open(tmp_path, browser, artifacts):
    import requests
    from playwright.sync_api import expect

    token = "t0ken-" + "x" * 30
    token_file = tmp_path / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "one.yaml").write_text(ONE)
    try:
        fleet.start_serve("--settle", "1", "--token-file", str(token_file))
        assert requests.get(fleet.control + "/healthz", timeout=5).ok
        assert requests.get(fleet.control + "/api/v1/watch/status", timeout=5).status_code == 401
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(fleet.control + "/ui/")
        form = page.locator("#token-form")
        expect(form).to_be_visible(timeout=WAIT_MS)
        page.fill("#token-input", "wrong-" + "y" * 30)
        page.click("#token-form button[type=submit]")
        expect(page.locator("#token-error")).to_contain_text("refused", timeout=WAIT_MS)
        page.fill("#token-input", token)
        page.click("#token-form button[type=submit]")
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        expect(form).to_be_hidden()
        expect(page.locator("#models tr[data-model=fake-one]")).to_have_count(1, timeout=WAIT_MS)
        # Kept for this tab: a reload needs no second typing.
        page.reload()
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        assert page.evaluate("sessionStorage.getItem('llmgw.token')") == token
        assert page.context.cookies() == [], "the token must not become a cookie"
        _shot(page, artifacts / "console-token.png")
    finally:
        fleet.close()


TRAFFIC = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: chat-a
    replicas: {min: 1, max: 3}
    autoscale: {metric: inflight, target: 2, scale_down_window: 3s, max_step: 1}
    profiles:
      - {name: cpu, engine: fake, gpus: 0, args: ["--tokens-per-second", "40", "--startup-delay", "0.3"]}
  - name: chat-b
    aliases: [bee]
    replicas: {min: 1, max: 2}
    autoscale: {metric: inflight, target: 2, scale_down_window: 3s, max_step: 1}
    profiles:
      - {name: h100, engine: fake, gpus: 1, args: ["--tokens-per-second", "40", "--startup-delay", "0.3"]}
"""
# Streams held open on each model while the load lasts: twice the target, so each scales up.
LOAD_STREAMS = 4
LOAD_SECONDS = 60


def _load(router: str, model: str, stop) -> list:
    import threading

    import requests

    def client() -> None:
        with requests.Session() as session:
            while not stop.is_set():
                try:
                    with session.post(router + "/v1/chat/completions", stream=True, timeout=30, json={
                            "model": model, "stream": True, "max_tokens": 60,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": "go"}]}) as resp:
                        for _ in resp.iter_lines():
                            if stop.is_set():
                                break
                except requests.RequestException:
                    stop.wait(0.2)
    threads = [threading.Thread(target=client, daemon=True) for _ in range(LOAD_STREAMS)]
    for t in threads:
        t.start()
    return threads


def test_console_charts_the_load_streams_a_playground_answer_and_finds_it_in_the_request_log(
        tmp_path, browser, artifacts):
    """Load on two models rises and falls on their charts with the autoscaler's replicas; the playground
    streams an answer from the fake engine through the router; the request log finds its request id."""
    import threading
    import time

    import requests
    from playwright.sync_api import expect

    fleet = Fleet(tmp_path)
    (fleet.catalogs / "traffic.yaml").write_text(TRAFFIC)
    stop = threading.Event()
    threads: list = []
    try:
        fleet.start_serve("--settle", "1", "--gpus", "2xH100-80GB")
        wait_until(lambda: fleet.ready("chat-a") and fleet.ready("chat-b"), "both models ready")
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(fleet.control + "/ui/")
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        fleet_card = page.locator('.chart-card[data-chart="(fleet)"]')
        expect(fleet_card).to_have_count(1, timeout=WAIT_MS)
        assert page.locator(".chart-card canvas").count() >= 3, "uPlot drew no canvas"

        # The load: both models, until each has scaled up and the charts hold points of it.
        threads = _load(fleet.router, "chat-a", stop) + _load(fleet.router, "bee", stop)
        card_a = page.locator('.chart-card[data-chart="chat-a"]')
        card_b = page.locator('.chart-card[data-chart="chat-b"]')

        def peaked(card, replicas):
            # The load's rise, and the autoscaler's answer to it: more replicas wanted, and ready.
            return (float(card.get_attribute("data-peak-requests") or 0) > 0
                    and float(card.get_attribute("data-peak-desired") or 0) >= replicas
                    and float(card.get_attribute("data-peak-ready") or 0) >= replicas
                    and int(card.get_attribute("data-points") or 0) >= 6)
        # A minute of it, as an operator's dashboard would see a burst (the waits are bounds, not judgements).
        minute = time.monotonic() + LOAD_SECONDS
        wait_until(lambda: peaked(card_a, 2) and peaked(card_b, 2) and time.monotonic() >= minute,
                   "a minute of load, both models' charts showing it and more replicas wanted", timeout=180)
        _shot(page, artifacts / "console-traffic-load.png")
        at_peak = int(card_a.get_attribute("data-points"))
        stop.set()
        for t in threads:
            t.join(timeout=30)
        # The fall: a point with no request after the load, and the autoscaler back at the minimum.
        wait_until(lambda: card_a.get_attribute("data-last-requests") == "0"
                   and card_b.get_attribute("data-last-requests") == "0", "the charts show the load's end",
                   timeout=60)
        wait_until(lambda: [m["desired"] for m in fleet.status()["models"]] == [1, 1], "back to one replica each",
                   timeout=90)
        # And the charts show the replicas' fall too: a point with one replica wanted, after the peak.
        wait_until(lambda: all(card.get_attribute("data-last-desired") == "1" for card in (card_a, card_b)),
                   "the charts show the autoscaler back at one replica", timeout=60)
        # The page kept what it had and added the new points (the stream sends only those).
        assert int(card_a.get_attribute("data-points")) > at_peak
        history = requests.get(fleet.control + "/api/v1/history?model=chat-a", timeout=10).json()
        assert int(card_a.get_attribute("data-points")) >= len(history["t"]) - 1
        desired = [v for v in history["models"]["chat-a"]["desired"] if v is not None]
        assert max(desired) >= 2 and desired[-1] == 1, desired
        assert max(v or 0 for v in history["models"]["chat-a"]["ttft_p99"]) > 0

        # The GPU view: chat-b's replica on one of the two simulated H100s.
        gpu_b = fleet.ready("chat-b")[0]["id"]
        expect(page.locator("#gpu-nodes .gpu-node")).to_contain_text(gpu_b, timeout=WAIT_MS)
        expect(page.locator("#gpu-nodes .gpu-node")).to_contain_text("the whole GPU")

        # The playground: an answer streamed from the fake engine, through the router.
        page.select_option("#pg-model", "chat-a")
        page.fill("#pg-prompt", "Tell me something.")
        page.click("#pg-send")
        out = page.locator("#pg-output")
        expect(out).to_have_attribute("data-state", "done", timeout=WAIT_MS)
        assert len(out.inner_text().strip()) > 0, "the playground got no text"
        expect(page.locator("#pg-stats")).to_contain_text("TTFT", timeout=WAIT_MS)
        expect(page.locator("#pg-stats")).to_contain_text("tokens in")
        rid = out.get_attribute("data-request-id")
        assert rid and rid.startswith("console-")

        # The request log: that request, found by its id, served by chat-a with its tokens.
        page.fill("#rl-id", rid)
        page.click("#rl-form button[type=submit]")
        row = page.locator(f'#requests tr[data-request-id="{rid}"]')
        expect(row).to_have_count(1, timeout=WAIT_MS)
        expect(row).to_contain_text("chat-a")
        expect(row.locator('td[data-label="Status"]')).to_have_text("200")
        found = requests.get(fleet.control + "/api/v1/requests", params={"id": rid}, timeout=10).json()["requests"]
        assert [r["id"] for r in found] == [rid] and found[0]["tokens_out"] > 0 and found[0]["replica"]
        # The load's streams are there too, under the alias they asked for.
        assert requests.get(fleet.control + "/api/v1/requests", params={"model": "bee", "limit": 1},
                            timeout=10).json()["requests"][0]["asked"] == "bee"
        _shot(page, artifacts / "console-traffic.png")
        assert errors == [], errors
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        fleet.close()


GANG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: gang
    profiles: [{name: two, engine: fake, pool: gpu, gpus: 1, nodes: 2}]
"""


def test_console_shows_a_replica_spanning_nodes_as_one_row_with_its_members(tmp_path, browser, artifacts):
    from playwright.sync_api import expect

    fleet = Fleet(tmp_path)
    (fleet.catalogs / "gang.yaml").write_text(GANG)
    try:
        fleet.start_controller()
        fleet.start_agent("n1", "1xL4-24GB", "gpu")
        fleet.start_agent("n2", "1xL4-24GB", "gpu")
        row = wait_until(lambda: (rows := fleet.ready("gang")) and len(rows[0].get("members", ())) == 2
                         and all(m["state"] == "ready" for m in rows[0]["members"]) and rows[0], "gang's group ready")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(fleet.control + "/")
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        # One row for the group (its worker has none of its own), its members rank by rank in it.
        expect(page.locator("#replicas tr[data-replica]")).to_have_count(1, timeout=WAIT_MS)
        members = page.locator(f'#replicas ul[data-members="{row["id"]}"] li')
        expect(members).to_have_count(2, timeout=WAIT_MS)
        for i, m in enumerate(row["members"]):
            expect(members.nth(i)).to_contain_text(f"rank {m['rank']} · {m['node']} · GPUs 0")
            expect(members.nth(i)).to_contain_text("ready")
        expect(page.locator(f'#replicas tr[data-replica="{row["id"]}"]')).to_contain_text("2 nodes")
        _shot(page, artifacts / "console-group.png")
        assert errors == []
    finally:
        fleet.close_checked()


def lora_catalog(*adapters: str) -> str:
    # The engine holds one adapter (the fake's --max-adapters): a second's load is refused by it.
    return yaml.safe_dump({"apiVersion": "llmgw/v1", "kind": "Catalog", "models": [{
        "name": "base", "lora": {"max_loras": 2},
        "profiles": [{"name": "cpu", "engine": "fake", "gpus": 0, "args": ["--max-adapters", "1"]}],
        "adapters": [{"name": a, "source": f"org/{a}"} for a in adapters]}]})


def test_console_shows_a_replicas_adapters_and_the_engines_reason_for_a_failed_load(tmp_path, browser, artifacts):
    from playwright.sync_api import expect

    fleet = Fleet(tmp_path)
    models = fleet.catalogs / "models.yaml"
    models.write_text(lora_catalog("first", "second"))
    try:
        fleet.start_serve("--settle", "1")
        (replica,) = wait_until(lambda: fleet.ready("base"), "the base replica ready")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(fleet.control + "/")
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        row = page.locator(f'#replicas tr[data-replica="{replica["id"]}"]')
        expect(row.locator(f'[data-adapters="{replica["id"]}"]')).to_have_text(
            "adapters: first, second (failed)", timeout=WAIT_MS)
        expect(row.locator(".error")).to_contain_text(
            "adapter second failed: engine answered 400: Loading lora second failed", timeout=WAIT_MS)
        _shot(page, artifacts / "console-adapters.png")
        # first leaves the catalog: the row follows without a reload, second loaded once there is room.
        models.write_text(lora_catalog("second"))
        expect(row.locator(f'[data-adapters="{replica["id"]}"]')).to_have_text("adapters: second", timeout=WAIT_MS)
        expect(row.locator(".error")).to_have_count(0)
        assert errors == []
    finally:
        fleet.close_checked()


def test_console_puts_a_history_sent_in_parts_on_its_charts(tmp_path, browser, artifacts, monkeypatch):
    """A big first history (an hour of many models) comes as the times and the fleet's series, then the models'
    series in parts (control/webui.py, HISTORY_PART): the page charts every model of every part."""
    import time

    import requests
    from playwright.sync_api import expect

    from llmgwctl.control import webui
    from llmgwctl.control.history import History, ModelSample

    fleet = Fleet(tmp_path)
    (fleet.catalogs / "one.yaml").write_text(ONE)
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: fleet.ready("fake-one"), "fake-one ready")
        # The controller's own summary, so the page renders as it would; the history is made here.
        with requests.get(fleet.control + "/api/v1/watch/console", stream=True, timeout=30) as resp:
            frames = resp.iter_lines(delimiter=b"\n\n")
            summary = next(f for f in frames if b"event: summary" in f)
        h = History()
        names = ["alpha", "beta", "gamma", "delta"]
        t0 = time.time() - 40 * h.interval
        for k in range(40):
            h.sample(t0 + k * h.interval, (ModelSample(n, k % 3, 1 + i, 1, None, None) for i, n in enumerate(names)))
        monkeypatch.setattr(webui, "HISTORY_PART", 3000)
        events = webui.history_events(h.to_dict())
        assert [k for k, _ in events].count(b"history-part") >= 2, "the history was not cut into parts"
        body = summary + b"\n\n" + b"".join(b"event: %s\ndata: %s\n\n" % (k, d) for k, d in events)

        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.route("**/api/v1/watch/console", lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=body))
        page.goto(fleet.control + "/ui/")
        for i, name in enumerate(names):
            card = page.locator(f'.chart-card[data-chart="{name}"]')
            expect(card).to_have_attribute("data-points", "40", timeout=WAIT_MS)
            expect(card).to_have_attribute("data-peak-desired", str(1 + i))
        _shot(page, artifacts / "console-history-parts.png")
        assert errors == [], errors
    finally:
        fleet.close()
