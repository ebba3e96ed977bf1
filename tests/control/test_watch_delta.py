"""The endpoint watch's delta answers (issue 19), over real HTTP against the real control API.

- A router asking with `delta=1` and a version the controller answered gets
  what changed since (added or changed endpoints, removed ids; the catalog
  only when it changed), and that applied to what it held is the whole list.
- One without the parameter (an older router), one asking from a version the
  controller does not know (a restarted controller, or too old) and one
  asking with 0 get the whole list, as before.
- The real router's watch client (`ControllerWatch`) applies deltas and ends
  with the controller's list; a delta that is not from its version is refused
  and it asks for the whole list next.
"""
from __future__ import annotations

import aiohttp
import pytest

from llmgwctl.catalog import Catalog, Model, Profile, Replicas
from llmgwctl.contracts import Endpoint
from llmgwctl.control import schemas
from llmgwctl.control.watchlog import WatchLog
from llmgwctl.router import Router
from llmgwctl.router.watch import ControllerWatch

from ..controlplane import ControlPlane

NODE = "n1"


def cat(weight: float = 1.0, extra: bool = False) -> Catalog:
    models = [Model(name="m", source="org/m", replicas=Replicas(4, 4),
                    profiles=(Profile(name="p", engine="fake", gpus=0, weight=weight),))]
    if extra:
        models.append(Model(name="other", source="org/other", profiles=(Profile(name="p", engine="fake", gpus=0),)))
    return Catalog(models)


def ep(i: int, port: int | None = None) -> Endpoint:
    return Endpoint(f"r{i}", "m", "p", "fake", f"http://127.0.0.1:{port or 9000 + i}")


async def watch(session, plane, after, delta=True):
    params = {"after": str(after), **({"delta": "1"} if delta else {})}
    async with session.get(f"{plane.url}/api/v1/watch/endpoints", params=params) as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert schemas.problems("watch-endpoints", doc) == [], "whole or delta, it follows the published schema"
    return doc


def applied(held: dict, doc: dict) -> dict:
    """A router's list (replica id -> endpoint dict) after applying `doc`, whole or delta."""
    if "delta" not in doc:
        return {e["replica_id"]: e for e in doc["endpoints"]}
    out = dict(held)
    for rid in doc["delta"]["removed"]:
        del out[rid]
    out.update((e["replica_id"], e) for e in doc["delta"]["endpoints"])
    return out


async def test_a_delta_is_what_changed_and_applied_gives_the_whole_list(tmp_path):
    plane = ControlPlane(tmp_path, hold=0.05)
    await plane.start()
    try:
        await plane.serve(cat(), NODE, [ep(1), ep(2), ep(3)])
        async with aiohttp.ClientSession() as session:
            first = await watch(session, plane, 0)
            assert "delta" not in first and len(first["endpoints"]) == 3, "a first call gets the whole list"
            held, version = applied({}, first), first["version"]

            # Nothing changed: a held poll answers the same version, as a delta of nothing.
            same = await watch(session, plane, version)
            assert same["version"] == version and same["delta"] == {"since": version, "endpoints": [], "removed": []}

            # r1 gone, r2 moved to another port, r4 new; the catalog as it was.
            await plane.serve(cat(), NODE, [ep(2, port=9102), ep(3), ep(4)])
            doc = await watch(session, plane, version)
            assert doc["delta"]["since"] == version and "catalog" not in doc and "models" in doc
            assert sorted(e["replica_id"] for e in doc["delta"]["endpoints"]) == ["r2", "r4"]
            assert doc["delta"]["removed"] == ["r1"]
            whole = await watch(session, plane, version, delta=False)
            assert "delta" not in whole and whole["version"] == doc["version"], "an older router: the whole list"
            held = applied(held, doc)
            assert held == applied({}, whole)

            # A catalog change that changes a profile's weight: the catalog rides along, every endpoint changed.
            before = doc["version"]
            await plane.serve(cat(weight=3.0), NODE, [ep(2, port=9102), ep(3), ep(4)])
            doc = await watch(session, plane, before)
            assert doc["catalog"] == cat(weight=3.0).to_dict()
            assert {e["weight"] for e in doc["delta"]["endpoints"]} == {3.0} and len(doc["delta"]["endpoints"]) == 3
            assert applied(held, doc) == applied({}, await watch(session, plane, 0))

            # A version this controller never answered (another controller's, or long gone): the whole list.
            doc = await watch(session, plane, version - 12345)
            assert "delta" not in doc and len(doc["endpoints"]) == 3 and "catalog" in doc
    finally:
        await plane.stop()


def test_the_log_forgets_old_versions_and_a_version_answered_two_ways():
    log = WatchLog(keep=2)
    a, b = (ep(1),), (ep(1), ep(2))
    log.answered(1, a, "c1")
    log.answered(2, b, "c1")
    assert [e.replica_id for e in log.delta(1, b, "c1").changed] == ["r2"]
    log.answered(3, b, "c2")
    assert log.delta(1, b, "c2") is None, "past HISTORY: the whole list"
    assert log.delta(2, b, "c2").catalog_changed and not log.delta(3, b, "c2").catalog_changed
    log.answered(3, a, "c2")             # one version, two states: no delta can start from it
    assert log.delta(3, a, "c2") is None


def held(router: Router) -> tuple:
    """The router's endpoints in the controller's order (by id); a delta appends newcomers at the end."""
    return tuple(sorted((s.endpoint for s in router.balancer.states()), key=lambda e: e.replica_id))


async def test_the_router_watch_applies_deltas_and_ends_with_the_controllers_list(tmp_path):
    plane = ControlPlane(tmp_path, hold=0.05)
    await plane.start()
    router = Router()
    try:
        await plane.serve(cat(), NODE, [ep(1), ep(2)])
        async with aiohttp.ClientSession() as session:
            w = ControllerWatch(router, plane.url, session)
            assert await w.poll_once() is True
            for endpoints, catalog in (([ep(2), ep(3)], cat()),
                                       ([ep(2, port=9202), ep(3), ep(4)], cat(extra=True)),
                                       ([ep(4)], cat(weight=2.0, extra=True))):
                await plane.serve(catalog, NODE, endpoints)
                assert await w.poll_once() is True
                assert w.version == plane.controller.watch.version
                assert held(router) == plane.endpoints
                assert router.catalog == catalog
            assert w.deltas == 3, "every answer after the first was a delta"
            # A delta that is not from the version held (no controller of ours sends one) is
            # refused, and the next poll asks for the whole list.
            with pytest.raises(ValueError, match="holds another"):
                w._apply_delta({"since": w.version - 1, "endpoints": [], "removed": ["r4"]})
            assert w.version == 0
            assert await w.poll_once() is True and held(router) == plane.endpoints
    finally:
        await plane.stop()
