"""One sink contract (`contracts.RouterSink`): every source tells a router through it, and the Router takes all of it."""
from __future__ import annotations

import asyncio
import inspect

import aiohttp
import pytest

from llmgwctl.aio import cancel_and_wait
from llmgwctl.catalog import CatalogError, Model, Profile, Replicas, loader
from llmgwctl.contracts import Endpoint, RouterSink
from llmgwctl.router import Router
from llmgwctl.router.watch import ControllerWatch

from ..controlplane import ControlPlane
from .harness import catalog

METHODS = ("set_catalog", "set_model_states", "set_endpoints", "change_endpoints")
NODE = "n1"


class Recording:
    """A sink that takes the whole contract and notes each call."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def set_catalog(self, catalog):
        self.calls.append(("set_catalog", catalog))

    def set_model_states(self, states):
        self.calls.append(("set_model_states", tuple(states)))

    def set_endpoints(self, endpoints):
        self.calls.append(("set_endpoints", tuple(e.replica_id for e in endpoints)))

    def change_endpoints(self, endpoints, changed):
        self.calls.append(("change_endpoints", {rid: ep is not None for rid, ep in changed.items()}))


def test_the_contract_is_the_four_pushes_and_the_router_takes_every_one():
    declared = {name for name, _ in inspect.getmembers(RouterSink, inspect.isfunction) if not name.startswith("_")}
    assert declared == set(METHODS)
    for name in METHODS:
        wanted = list(inspect.signature(getattr(RouterSink, name)).parameters)
        assert list(inspect.signature(getattr(Router, name)).parameters) == wanted, name


async def test_the_watch_tells_a_sink_through_the_contract_alone(tmp_path, monkeypatch):
    # The catalog comes as a document and is checked as one: never turned back into text.
    def no_text(*args, **kwargs):
        raise AssertionError("the watch's catalog went through the YAML loader")
    monkeypatch.setattr(loader, "load_text", no_text)
    plane = ControlPlane(tmp_path)
    await plane.start()
    try:
        cat = catalog(Model(name="m", source="org/m", replicas=Replicas(2, 2),
                            profiles=(Profile(name="default", engine="fake", gpus=0),)))
        ep = Endpoint("r1", "m", "default", "fake", "http://127.0.0.1:9")
        await plane.serve(cat, NODE, [ep])
        sink = Recording()
        async with aiohttp.ClientSession() as session:
            watch = ControllerWatch(sink, plane.url, session)
            assert await watch.poll_once() is True
            # A whole answer: the catalog first, then the model states, then the whole list.
            assert [name for name, _ in sink.calls] == ["set_catalog", "set_model_states", "set_endpoints"]
            assert sink.calls[0][1] == cat and sink.calls[2][1] == ("r1",)
            assert watch.catalog_version == cat.version
            sink.calls.clear()
            await plane.serve(cat, NODE, [ep, Endpoint("r2", "m", "default", "fake", "http://127.0.0.1:10")])
            assert await watch.poll_once() is True
            # A delta: what changed, at the cost of the change.
            assert [name for name, _ in sink.calls] == ["set_model_states", "change_endpoints"]
            assert sink.calls[-1][1] == {"r2": True} and watch.deltas == 1
    finally:
        await plane.stop()


def test_a_catalog_the_router_cannot_load_is_refused_naming_the_controller_it_came_from():
    from llmgwctl.router.watch import _load_catalog

    with pytest.raises(CatalogError) as info:
        _load_catalog({"apiVersion": "llmgw/v1", "kind": "Catalog", "models": "none"},
                      "<catalog from http://127.0.0.1:8081>")
    assert str(info.value).startswith("<catalog from http://127.0.0.1:8081>: models: expected a list")


async def test_the_static_source_tells_a_sink_the_catalog_before_the_endpoints_read_against_it(tmp_path):
    from llmgwctl.catalog import load_text
    from llmgwctl.router.static import StaticSource

    catalogs = tmp_path / "catalogs"
    catalogs.mkdir()
    text = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: m\n    profiles: [{name: p, engine: fake, gpus: 0, priority: 3}]\n"
    (catalogs / "c.yaml").write_text(text)
    (tmp_path / "endpoints.yaml").write_text("endpoints: [{model: m, url: 'http://127.0.0.1:9', id: e1}]\n")
    source = StaticSource(tmp_path / "endpoints.yaml", catalogs)
    first = source.load_initial()
    sink, stop, tasks = Recording(), asyncio.Event(), []
    source.start(sink, stop, tasks)
    try:
        assert [name for name, _ in sink.calls] == ["set_catalog", "set_endpoints"]
        assert sink.calls[0][1] == first and sink.calls[1][1] == ("e1",)
        sink.calls.clear()
        # A swap: the new catalog, then the file read again against it.
        source.live.swap(load_text(text.replace("priority: 3", "priority: 7")))
        await asyncio.wait_for(asyncio.gather(*[t for t in tasks if t.get_name() == "endpoints-reread"]), 10)
        assert [name for name, _ in sink.calls] == ["set_catalog", "set_endpoints"]
    finally:
        stop.set()
        await cancel_and_wait(*tasks)
