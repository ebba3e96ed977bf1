"""The reconcile loop cannot fail silently (issue 13, "loops that cannot die silently").

At b616774 a pass that raised was logged and nothing else: status and
/metrics said nothing, `llmgwctl status` showed a healthy fleet, and a pass
that raised before publishing (as `weight: .nan` made every one do) never
published an endpoint list again. Here a real Controller, its reconcile loop
and its control API run in-process; agents are played by reports, and the
fault is put at the edge the reconciler reads (router usage), as a bug there
would show.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from llmgwctl.cli.status import render
from llmgwctl.control.api import ControlAPI
from llmgwctl.control.controller import Controller
from llmgwctl.httpserver import bound_port
from tests.support import until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: alpha
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: beta
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


class FlakyUsage:
    """Router usage that raises while `broken` is set: a bug at the reconciler's edge."""

    def __init__(self, real):
        self.real, self.broken = real, False

    def usage_snapshot(self):
        if self.broken:
            raise RuntimeError("usage snapshot broke")
        return self.real.usage_snapshot()


def report(node: str, specs, ready: set[str]) -> dict:
    return {"node": node, "pools": [], "engines": {"fake": {"available": True, "reason": ""}}, "gpus": [],
            "replicas": [{"id": s.id, "spec_hash": s.spec_hash, "model": s.model, "profile": s.profile,
                          "engine": s.engine, "gpu_indices": [], "port": 20000 + i, "pid": 20000 + i,
                          "state": "ready" if s.id in ready else "starting", "restarts": 0,
                          "url": f"http://127.0.0.1:{20000 + i}", "spec": s.to_dict()}
                         for i, s in enumerate(specs)]}


async def scenario(tmp_path, caplog):
    (tmp_path / "models.yaml").write_text(CATALOG)
    controller = Controller(str(tmp_path), settle=0)
    controller.load()
    flaky = controller.reconciler.usage = FlakyUsage(controller.reconciler.usage)
    runner = web.AppRunner(ControlAPI(controller).app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{bound_port(runner)}"
    stop = asyncio.Event()
    loop_task = asyncio.create_task(controller.run(stop, tick=0.02))
    desired = controller.desired

    def agent(ready_models: set[str]) -> None:
        entry = desired.get("n1")
        specs = entry[1] if entry else ()
        controller.agent_reported("n1", report("n1", specs, {s.id for s in specs if s.model in ready_models}))

    def endpoints() -> set[str]:
        return {e.model for e in controller.reconciler.endpoints}

    try:
        async with aiohttp.ClientSession() as http:
            async def status() -> dict:
                async with http.get(base + "/api/v1/status") as resp:
                    assert resp.status == 200
                    return await resp.json()

            async def metrics() -> str:
                async with http.get(base + "/metrics") as resp:
                    return await resp.text()

            agent(set())
            await until(lambda: len((desired.get("n1") or (0, ()))[1]) == 2, "both replicas placed", nudge=lambda: agent(set()))
            await until(lambda: endpoints() == {"alpha"}, "alpha ready", nudge=lambda: agent({"alpha"}))
            assert (await status())["reconciler"] == {"loop": "ok", "failures": 0, "last_failure": None}

            caplog.clear()
            flaky.broken = True
            await until(lambda: controller.reconciler.failures >= 3, "three failed passes")
            # Every failed pass still published what runs: beta, reported ready
            # now, joins the router although no pass gets to planning.
            await until(lambda: endpoints() == {"alpha", "beta"}, "beta in the router while degraded",
                        nudge=lambda: agent({"alpha", "beta"}))
            assert not loop_task.done()
            st = await status()
            part = st["reconciler"]
            assert part["loop"] == "degraded" and part["failures"] >= 3, part
            assert part["last_failure"]["error"] == "RuntimeError: usage snapshot broke"
            assert part["last_failure"]["what"] == "reconcile pass" and part["last_failure"]["at"] > 0
            assert st["catalog"]["watcher"] == "ok"
            text = render(st)
            assert "reconciler DEGRADED" in text and "usage snapshot broke" in text, text
            assert "catalog watcher DEGRADED" not in text
            page = await metrics()
            failures = next(float(line.split()[-1]) for line in page.splitlines()
                            if line.startswith("llmgw_reconcile_failures_total "))
            assert failures >= 3, page
            assert 'llmgw_loop_degraded{loop="reconciler"} 1.0' in page, page
            assert 'llmgw_loop_degraded{loop="catalog-watcher"} 0.0' in page, page
            # The traceback once, then one line per repeat: the log says what broke without burying it.
            failed = [r for r in caplog.records if r.name == "llmgw.reconciler" and r.levelno == logging.ERROR]
            assert "Traceback" in failed[0].getMessage() and "usage snapshot broke" in failed[0].getMessage()
            assert all("Traceback" not in r.getMessage() for r in failed[1:]) and len(failed) >= 3

            flaky.broken = False
            passes = controller.reconciler.passes
            await until(lambda: not controller.reconciler.degraded and controller.reconciler.passes > passes + 1,
                        "a good pass again")
            st = await status()
            assert st["reconciler"]["loop"] == "ok" and st["reconciler"]["failures"] >= 3
            assert "DEGRADED" not in render(st)
            assert 'llmgw_loop_degraded{loop="reconciler"} 0.0' in await metrics()
            assert endpoints() == {"alpha", "beta"}
    finally:
        stop.set()
        await asyncio.wait_for(loop_task, 20)
        await runner.cleanup()


def test_a_failing_pass_is_counted_shown_and_survived(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmgw")
    asyncio.run(scenario(tmp_path, caplog))


async def preview_bug(tmp_path):
    (tmp_path / "models.yaml").write_text(CATALOG)
    controller = Controller(str(tmp_path), settle=0)
    controller.load()

    def broken_preview(catalog):
        raise ZeroDivisionError("a bug in planning")

    # A bug in planning (none is known: this puts one there) must not be a bare 500.
    controller.reconciler.preview = broken_preview
    runner = web.AppRunner(ControlAPI(controller).app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"filename": "more.yaml", "content": CATALOG.replace("alpha", "gamma").replace("beta", "delta")}
            async with http.post(f"http://127.0.0.1:{bound_port(runner)}/api/v1/catalog", json=body) as resp:
                assert resp.status == 500
                assert resp.content_type == "application/json"
                error = (await resp.json())["error"]
        assert error["type"] == "server_error" and error["code"] == 500
        assert "ZeroDivisionError: a bug in planning" in error["message"] and "nothing was written" in error["message"]
        assert not (tmp_path / "more.yaml").exists()
    finally:
        await runner.cleanup()


def test_a_bug_in_the_apply_preview_is_a_json_error_and_writes_nothing(tmp_path):
    asyncio.run(preview_bug(tmp_path))
