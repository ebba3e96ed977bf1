"""The standalone router: the static endpoint file, the CLI as a real process, and the controller watch client."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import aiohttp
import openai
import pytest
from aiohttp import web

from llmgwctl.catalog import Catalog, Model, Profile
from llmgwctl.contracts import Endpoint
from llmgwctl.router import Router
from llmgwctl.router.static import EndpointFileError, parse_endpoints
from llmgwctl.router.watch import BACKOFF_FIRST, BACKOFF_MAX, ControllerWatch, WatchError

from .harness import _readline, catalog, wait_until

CATALOG_YAML = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: small-model
    aliases: [small]
    source: org/small
    profiles:
      - {name: gpu, engine: fake, gpus: 0, priority: 10, weight: 2}
      - {name: cpu, engine: fake, gpus: 0, priority: 1}
"""


def two_profile_catalog() -> Catalog:
    return Catalog([Model(name="small-model", aliases=("small",), profiles=(
        Profile("gpu", "fake", gpus=0, priority=10, weight=2), Profile("cpu", "fake", gpus=0, priority=1)))])


def test_static_endpoints_take_defaults_from_the_catalog():
    eps = parse_endpoints({"endpoints": [
        {"model": "small", "url": "http://127.0.0.1:9001/"},
        {"model": "small-model", "url": "http://127.0.0.1:9002", "profile": "cpu", "id": "c", "weight": 5,
         "metrics_path": None},
    ]}, two_profile_catalog())
    assert eps == [
        Endpoint("small-model@127.0.0.1:9001", "small-model", "gpu", "fake", "http://127.0.0.1:9001", 10, 2.0),
        Endpoint("c", "small-model", "cpu", "fake", "http://127.0.0.1:9002", 1, 5.0, None),
    ]


def test_static_endpoint_file_reports_every_problem_with_its_place():
    with pytest.raises(EndpointFileError) as info:
        parse_endpoints({"endpoints": [
            {"model": "nope", "url": "http://h:1"},
            {"model": "small", "url": "http://h:2", "profile": "tpu"},
            {"url": "http://h:3"},
            {"model": "small", "url": "h:4"},
            {"model": "small", "url": "http://h:5", "colour": "red"},
            {"model": "small", "url": "http://h:6", "id": "x"},
            {"model": "small", "url": "http://h:7", "id": "x"},
            {"model": "small", "url": "http://h:99999"},
        ]}, two_profile_catalog(), "eps.yaml")
    lines = str(info.value).splitlines()
    assert lines[0].startswith("eps.yaml: endpoints[0].model: 'nope' is not a model or alias")
    assert lines[1].startswith("eps.yaml: endpoints[1].profile: 'tpu' is not a profile of 'small-model'")
    assert lines[2] == "eps.yaml: endpoints[2].model: required"
    assert lines[3].startswith("eps.yaml: endpoints[3]: endpoint small-model@h:4: url must look like")
    assert lines[4].startswith("eps.yaml: endpoints[4]: unknown field 'colour'")
    assert lines[5].startswith("eps.yaml: endpoints[6].id: 'x' is already used by endpoints[5]")
    # Past the Endpoint's own check, a port no socket has: refused here, not left for the router to skip.
    assert lines[6].startswith("eps.yaml: endpoints[7].url: not a usable endpoint URL: 'http://h:99999'")
    with pytest.raises(EndpointFileError, match="expected a mapping with an 'endpoints' list"):
        parse_endpoints([], two_profile_catalog())


@pytest.fixture
def router_process(tmp_path):
    started = []

    def spawn(*args: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        line = _readline(proc, 15)
        return proc, line.rsplit(" ", 1)[-1].strip()

    yield spawn
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_cli_static_mode_serves_the_openai_client(engines, router_process, tmp_path):
    gpu = engines("small-model", "g1")
    cpu = engines("small-model", "c1")
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "models.yaml").write_text(CATALOG_YAML)
    (tmp_path / "eps.yaml").write_text(textwrap.dedent(f"""\
        endpoints:
          - {{model: small, url: "{gpu.url}", id: g1}}
          - {{model: small, url: "{cpu.url}", id: c1, profile: cpu}}
        """))
    proc, url = router_process("--endpoints", str(tmp_path / "eps.yaml"), "--catalogs", str(tmp_path / "cat"))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert raw.headers["x-llmgw-replica"] == "g1" and raw.parse().model == "small-model"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="small-model", prompt="x", max_tokens=3, stream=True) if c.choices)
    assert "replica=g1" in text
    # SIGTERM stops it cleanly.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0


def test_cli_rejects_bad_files_with_the_reason(router_process, tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "models.yaml").write_text(CATALOG_YAML)
    (tmp_path / "eps.yaml").write_text("endpoints:\n  - {model: big, url: 'http://127.0.0.1:1'}\n")
    done = subprocess.run([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0",
                           "--endpoints", str(tmp_path / "eps.yaml"), "--catalogs", str(tmp_path / "cat")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "endpoints[0].model: 'big' is not a model or alias in the catalog" in done.stderr
    done = subprocess.run([sys.executable, "-m", "llmgwctl", "router", "--controller", "http://x",
                           "--endpoints", "f"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "not both" in done.stderr


class FakeController:
    """Stands in for the controller's watch endpoint, as the watch module's docstring specifies it."""

    def __init__(self) -> None:
        self.version = 0
        self.catalog = Catalog()
        self.endpoints: list[Endpoint] = []
        self.changed = asyncio.Event()
        self.wakes: list[str] = []
        self.hold = 30.0
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.port = 0

    def publish(self, cat: Catalog, endpoints: list[Endpoint]) -> None:
        self.catalog, self.endpoints = cat, endpoints
        self.version += 1
        self.changed.set()
        self.changed = asyncio.Event()

    async def watch(self, request: web.Request) -> web.Response:
        after = int(request.query["after"])
        if after == self.version:
            try:
                await asyncio.wait_for(self.changed.wait(), self.hold)
            except asyncio.TimeoutError:
                pass
        return web.json_response({"version": self.version, "catalog": self.catalog.to_dict(),
                                  "endpoints": [e.to_dict() for e in self.endpoints]})

    async def wake(self, request: web.Request) -> web.Response:
        self.wakes.append((await request.json())["model"])
        return web.Response(status=202)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/watch/endpoints", self.watch)
        app.router.add_post("/api/v1/wake", self.wake)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


def test_watch_backoff_grows_to_its_cap_and_is_jittered():
    watch = ControllerWatch(Router(), "http://127.0.0.1:9", session=None, rand=lambda: 0.75)
    assert [watch.backoff.ceiling(n) for n in (1, 2, 3, 4, 30)] == [BACKOFF_FIRST, 1.0, 2.0, 4.0, BACKOFF_MAX]
    assert [watch.backoff.failure() for _ in range(3)] == [0.125, 0.25, 0.5]    # a quarter of each ceiling
    assert watch.failures == 3


async def test_watch_follows_the_controller_and_keeps_the_last_list_while_it_is_away():
    controller = FakeController()
    await controller.start()
    router = Router()
    cat = catalog(("m", ("alias",)))
    ep = Endpoint("r1", "m", "default", "fake", "http://127.0.0.1:9")
    controller.publish(cat, [ep])
    async with aiohttp.ClientSession() as session:
        watch = ControllerWatch(router, controller.url, session)
        assert await watch.poll_once() is True
        assert router.catalog == cat and watch.version == 1
        assert router.usage_snapshot() == {"r1": (None, 0)}
        # Nothing new: the controller holds the poll, then answers the same version.
        controller.hold = 0.05
        assert await watch.poll_once() is False
        # A change wakes the held poll at once.
        controller.hold = 30
        pending = asyncio.create_task(watch.poll_once())
        await asyncio.sleep(0.05)
        ep2 = Endpoint("r2", "m", "default", "fake", "http://127.0.0.1:10")
        controller.publish(cat, [ep, ep2])
        assert await asyncio.wait_for(pending, 10) is True
        assert set(router.usage_snapshot()) == {"r1", "r2"}
        # The controller goes away: the round fails, the router keeps what it had.
        await controller.stop()
        with pytest.raises(WatchError):
            await watch.poll_once()
        assert set(router.usage_snapshot()) == {"r1", "r2"} and router.catalog == cat
        # It comes back (restarted: its version starts over) and the router follows it.
        controller2 = FakeController()
        controller2.port = controller.port
        await controller2.start()
        cat2 = catalog(("m", ("alias", "another")))
        controller2.publish(cat2, [ep2])
        assert await watch.poll_once() is True
        assert router.catalog == cat2 and set(router.usage_snapshot()) == {"r2"}
        await controller2.stop()


async def test_watch_run_reconnects_with_backoff():
    controller = FakeController()
    await controller.start()
    port = controller.port
    await controller.stop()         # not there at first
    router = Router()
    sleeps: list[float] = []
    restarted = asyncio.Event()

    async def sleep(seconds: float) -> None:    # no real waiting: record, and bring the controller back after 3
        sleeps.append(seconds)
        if len(sleeps) == 3:
            restarted.set()
        await asyncio.sleep(0.01)

    async with aiohttp.ClientSession() as session:
        # rand 0: each delay is its whole ceiling, so the schedule reads plainly.
        watch = ControllerWatch(router, f"http://127.0.0.1:{port}", session, sleep=sleep, rand=lambda: 0.0)
        running = asyncio.create_task(watch.run())
        await asyncio.wait_for(restarted.wait(), 10)
        back = FakeController()
        back.port = port
        await back.start()
        back.publish(catalog(("m", ())), [Endpoint("r1", "m", "default", "fake", "http://127.0.0.1:9")])
        for _ in range(500):
            if router.usage_snapshot():
                break
            await asyncio.sleep(0.01)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await back.stop()
    assert sleeps[:3] == [0.5, 1.0, 2.0]
    assert set(router.usage_snapshot()) == {"r1"} and watch.failures == 0


def test_cli_controller_mode_follows_the_watch_and_wakes_through_it(engines, router_process):
    engine = engines("m", "r1")
    controller = FakeController()
    loop = asyncio.new_event_loop()
    import threading
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    async def publish(cat, eps):
        controller.publish(cat, eps)
    try:
        on_loop(controller.start())
        on_loop(publish(catalog(("m", ("alias",)), ("cold", ())), [engine.endpoint()]))
        proc, url = router_process("--controller", controller.url, "--cold-timeout", "0.5")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.completions.create(model="alias", prompt="x", max_tokens=2).model == "m"
        with pytest.raises(openai.InternalServerError, match="starting"):
            client.completions.create(model="cold", prompt="x", max_tokens=2)
        wait_until(lambda: controller.wakes == ["cold"], what="the wake to reach the controller")
        # The controller goes away; the router keeps serving what it knew.
        on_loop(controller.stop())
        assert client.completions.create(model="alias", prompt="x", max_tokens=2).model == "m"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
