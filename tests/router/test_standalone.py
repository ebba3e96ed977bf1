"""The standalone router: the static endpoint file, the CLI as a real process, and the controller watch client."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import aiohttp
import openai
import pytest
import requests

from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.contracts import Endpoint
from llmgwctl.router import Router
from llmgwctl.router.static import EndpointFileError, parse_endpoints
from llmgwctl.router.watch import BACKOFF_FIRST, BACKOFF_MAX, ControllerWatch, WatchError

from ..controlplane import ControlPlane, ControlPlaneThread
from ..procs import kill_group
from ..support import until
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
        kill_group(proc)


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
    assert raw.headers["x-llmgw-replica"] == "g1" and raw.parse().model == "small"  # the alias echoed
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


def test_watch_backoff_grows_to_its_cap_and_is_jittered():
    watch = ControllerWatch(Router(), "http://127.0.0.1:9", session=None, rand=lambda: 0.75)
    assert [watch.backoff.ceiling(n) for n in (1, 2, 3, 4, 30)] == [BACKOFF_FIRST, 1.0, 2.0, 4.0, BACKOFF_MAX]
    assert [watch.backoff.failure() for _ in range(3)] == [0.125, 0.25, 0.5]    # a quarter of each ceiling
    assert watch.failures == 3


NODE = "n1"     # the node whose agent reports the engines behind the endpoints


async def test_watch_follows_the_controller_and_keeps_the_last_list_while_it_is_away(tmp_path):
    plane = ControlPlane(tmp_path)
    await plane.start()
    router = Router()
    # Two replicas wanted: the controller keeps both once both are reported.
    cat = catalog(Model(name="m", aliases=("alias",), source="org/m", replicas=Replicas(2, 2),
                        profiles=(Profile(name="default", engine="fake", gpus=0),)))
    ep = Endpoint("r1", "m", "default", "fake", "http://127.0.0.1:9")
    await plane.serve(cat, NODE, [ep])
    assert [e.replica_id for e in plane.endpoints] == ["r1"]
    async with aiohttp.ClientSession() as session:
        watch = ControllerWatch(router, plane.url, session)
        assert await watch.poll_once() is True
        assert router.catalog == cat and watch.version == plane.controller.watch.version
        assert router.usage_snapshot() == {"r1": (None, 0)}
        # Nothing new: the controller holds the poll, then answers the same version.
        plane.hold = 0.05
        assert await watch.poll_once() is False
        # A change wakes the held poll at once.
        plane.hold = 30
        pending = asyncio.create_task(watch.poll_once())
        await until(lambda: plane.controller.watch.waiting == 1, "the router's poll to be held")
        ep2 = Endpoint("r2", "m", "default", "fake", "http://127.0.0.1:10")
        await plane.serve(cat, NODE, [ep, ep2])
        assert await asyncio.wait_for(pending, 10) is True
        assert set(router.usage_snapshot()) == {"r1", "r2"}
        # The controller goes away: the round fails, the router keeps what it had.
        await plane.stop()
        with pytest.raises(WatchError):
            await watch.poll_once()
        assert set(router.usage_snapshot()) == {"r1", "r2"} and router.catalog == cat
        # It comes back (restarted: a new series of versions, knowing only what
        # its agents report again) and the router follows it.
        plane2 = ControlPlane(tmp_path, port=plane.port)
        await plane2.start()
        cat2 = catalog(("m", ("alias", "another")))
        await plane2.serve(cat2, NODE, [ep2])
        assert await watch.poll_once() is True
        assert router.catalog == cat2 and set(router.usage_snapshot()) == {"r2"}
        assert watch.version == plane2.controller.watch.version
        await plane2.stop()


async def test_watch_run_reconnects_with_backoff(tmp_path):
    plane = ControlPlane(tmp_path)
    await plane.start()
    port = plane.port
    await plane.stop()         # not there at first
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
        back = ControlPlane(tmp_path, port=port)
        await back.start()
        await back.serve(catalog(("m", ())), NODE, [Endpoint("r1", "m", "default", "fake", "http://127.0.0.1:9")])
        await until(router.usage_snapshot, "the router to take the controller's endpoints")
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await back.stop()
    assert sleeps[:3] == [0.5, 1.0, 2.0]
    assert set(router.usage_snapshot()) == {"r1"} and watch.failures == 0


def test_cli_controller_mode_follows_the_watch_and_wakes_through_it(engines, router_process, tmp_path):
    engine = engines("m", "r1")
    plane = ControlPlaneThread(tmp_path)
    try:
        plane.serve(catalog(("m", ("alias",)), ("cold", ())), NODE, [engine.endpoint()])
        proc, url = router_process("--controller", plane.url, "--cold-timeout", "0.5")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.completions.create(model="alias", prompt="x", max_tokens=2).model == "alias"  # the engine saw "m"
        with pytest.raises(openai.InternalServerError, match="starting"):
            client.completions.create(model="cold", prompt="x", max_tokens=2)
        wait_until(lambda: plane.wakes == ["cold"], what="the wake to reach the controller")
        # The controller goes away; the router keeps serving what it knew.
        plane.stop()
        assert client.completions.create(model="alias", prompt="x", max_tokens=2).model == "alias"
    finally:
        plane.close()


ADAPTER_CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: base
    lora: {max_loras: 2}
    profiles: [{name: cpu, engine: fake, gpus: 0}]
    adapters:
      - {name: base-sql, aliases: [sql], source: org/base-sql}
"""


def test_static_endpoints_name_the_adapters_their_engines_serve(engines, router_process, tmp_path):
    # With no controller, the operator loaded the adapter on one engine and says so in the file.
    holder, plain = engines("base", "holder", "--max-loras", "2"), engines("base", "plain", "--max-loras", "2")
    loaded = requests.post(holder.url + "/v1/load_lora_adapter", timeout=10,
                           json={"lora_name": "base-sql", "lora_path": "org/base-sql"})
    assert loaded.status_code == 200, loaded.text
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "models.yaml").write_text(ADAPTER_CATALOG)
    (tmp_path / "eps.yaml").write_text(textwrap.dedent(f"""\
        endpoints:
          - {{model: base, url: "{holder.url}", id: holder, adapters: [sql]}}
          - {{model: base, url: "{plain.url}", id: plain}}
        """))
    proc, url = router_process("--endpoints", str(tmp_path / "eps.yaml"), "--catalogs", str(tmp_path / "cat"))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    served = [client.chat.completions.with_raw_response.create(
        model="sql", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3).headers["x-llmgw-replica"]
        for i in range(10)]
    assert served == ["holder"] * 10, "an adapter's requests go only where the file says it is served"
    base = {client.chat.completions.with_raw_response.create(
        model="base", messages=[{"role": "user", "content": f"b{i}"}], max_tokens=3).headers["x-llmgw-replica"]
        for i in range(10)}
    assert base == {"holder", "plain"}


def test_static_adapters_must_be_the_models_own():
    cat = two_profile_catalog()
    with pytest.raises(EndpointFileError) as info:
        parse_endpoints({"endpoints": [{"model": "small", "url": "http://h:1", "adapters": ["sql"]},
                                       {"model": "small", "url": "http://h:2", "adapters": "sql"}]}, cat, "eps.yaml")
    lines = str(info.value).splitlines()
    assert lines[0] == "eps.yaml: endpoints[0].adapters: 'sql' is not an adapter of 'small-model' in the catalog (it has: none)"
    assert lines[1] == "eps.yaml: endpoints[1].adapters: expected a list of adapter names, e.g. [small-model-sql]"
