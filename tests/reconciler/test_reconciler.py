"""The reconciler one pass at a time, with a fake clock and reports written as agents send them.

No processes here: the end-to-end tests in tests/e2e run the same logic with
real agents. These pin down the decisions -- settling, adoption, replacement,
drain, idle, wake, lost nodes -- where a fake clock makes them exact.
"""
import pytest

from llmgwctl.catalog import Live, load_text
from llmgwctl.contracts import ReplicaSpec
from llmgwctl.inventory import Inventory
from llmgwctl.reconciler import DesiredStore, Reconciler

from ..support import FakeClock

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"


def catalog(*models):
    return load_text(HEADER + "".join(models))


def model(name, *, pool="gpu", gpus=1, replicas=None, idle=None, args=None):
    out = f"  - name: {name}\n"
    if replicas is not None:
        out += f"    replicas: {replicas}\n"
    if idle is not None:
        out += f"    idle_timeout: {idle}\n"
    extra = f", args: {args}" if args else ""
    return out + f"    profiles: [{{name: p, engine: fake, pool: {pool}, gpus: {gpus}{extra}}}]\n"


class Sink:
    def __init__(self):
        self.pushes = []

    def set_endpoints(self, endpoints):
        self.pushes.append(tuple(endpoints))

    # The rest of the sink contract (contracts.RouterSink): a push is the whole list either way.
    def change_endpoints(self, endpoints, changed):
        self.pushes.append(tuple(endpoints))

    def set_model_states(self, states):
        pass

    def set_catalog(self, catalog):
        pass


class Usage:
    def __init__(self):
        self.snapshot = {}

    def usage_snapshot(self):
        return self.snapshot


class World:
    """A reconciler plus the agents' side, played by the test."""

    def __init__(self, cat, settle=5.0):
        self.clock = FakeClock()
        self.live = Live(cat)
        self.inventory = Inventory(clock=self.clock, unreachable_after=15)
        self.desired = DesiredStore()
        self.sink, self.usage = Sink(), Usage()
        self.rec = Reconciler(self.live, self.inventory, self.desired, endpoints=self.sink, usage=self.usage,
                              clock=self.clock, wall_clock=self.clock, settle=settle, drain_grace=30, replace_after=60)
        self.running = {}   # node -> {id: report dict}
        self.alive = set()  # nodes whose agents send heartbeats on every step
        self.pools = {}     # node -> the pools it last reported
        self.engines = ("fake",)    # what every node's agent says it can run


    def report(self, node, gpus=2, pools=None):
        self.alive.add(node)
        pools = self.pools.setdefault(node, ("gpu",)) if pools is None else pools
        self.pools[node] = pools
        self.inventory.report(node, {
            "node": node, "pools": list(pools), "engines": {e: {"available": True, "reason": ""} for e in self.engines},
            "gpus": [{"index": i, "uuid": f"{node}-{i}", "name": "A100"} for i in range(gpus)],
            "replicas": list(self.running.get(node, {}).values()),
        })

    def agent_follows(self, node, state="ready", states=None):
        """The agent runs exactly its desired list; everything it starts is `state`. `states` (replica id ->
        state): what those replicas report from now on, whether just started or running already."""
        entry = self.desired.get(node)
        specs = entry[1] if entry else ()
        running = self.running.setdefault(node, {})
        for rid in [r for r in running if r not in {s.id for s in specs}]:
            del running[rid]
        for spec in specs:
            want = (states or {}).get(spec.id, state)
            old = running.get(spec.id)
            if rid_changed(old, spec) or (states is not None and old["state"] != want):
                running[spec.id] = run_report(spec, want, port=20000 + len(running))
        self.report(node)

    def step(self, seconds=1.0):
        self.clock.now += seconds
        for node in self.alive:
            self.report(node)   # heartbeats keep coming however much time passes
        self.rec.reconcile_once()

    def quiet_pass(self, seconds=1.0):
        """A pass with no heartbeat in between, for what depends on counting reports."""
        self.clock.now += seconds
        self.rec.reconcile_once()

    def states(self):
        return sorted((r.spec.model, r.node, r.state) for r in self.rec.replicas.values())


def rid_changed(report, spec):
    return report is None or report["spec_hash"] != spec.spec_hash


def run_report(spec: ReplicaSpec, state, port):
    # A worker member of a group spanning nodes serves nothing: no URL, as its agent reports it.
    worker = spec.group is not None and spec.group.rank != 0
    return {"id": spec.id, "spec_hash": spec.spec_hash, "model": spec.model, "profile": spec.profile,
            "engine": spec.engine, "gpu_indices": list(spec.gpu_indices), "port": port, "pid": port,
            "state": state, "restarts": 0, "url": None if worker else f"http://127.0.0.1:{port}",
            "spec": spec.to_dict()}


def converge(world, nodes=("n1",), rounds=4):
    for _ in range(rounds):
        world.step()
        for node in nodes:
            world.agent_follows(node)
    world.step()


def test_settling_window_starts_nothing_and_ends_when_every_node_reported_twice():
    w = World(catalog(model("a")), settle=30)
    w.quiet_pass(0)
    w.report("n1")
    w.quiet_pass()
    assert not w.rec.settled and w.rec.replicas == {} and w.desired.get("n1") is None
    w.report("n1")
    w.quiet_pass(6.4)       # a heartbeat and a half (7.5 s of a 15 s node timeout) after the first pass: not yet
    assert not w.rec.settled
    w.quiet_pass(0.1)
    assert w.rec.settled and w.states() == [("a", "n1", "pending")]
    assert len(w.desired.get("n1")[1]) == 1


def test_a_node_still_backing_off_after_a_restart_is_waited_for():
    """CI: after a controller restart n2 reported twice at once (its second report was driven by
    the new desired list) while n1, the only node of pool `gpu`, was still in its retry backoff.
    Ending the window there declared n1's model unplaceable and would place n1's replicas again
    elsewhere; the window must last until a node backing off has had its retry land."""
    w = World(catalog(model("big", pool="gpu"), model("small", pool="cpu")), settle=0)
    w.report("n1")
    w.report("n2", pools=("cpu",))
    converge(w, nodes=("n1", "n2"))
    assert len(w.rec.replicas) == 2
    fresh = World(w.live.current, settle=15)
    fresh.running, fresh.pools = w.running, w.pools
    fresh.quiet_pass(0)
    for _ in range(2):
        fresh.report("n2", pools=("cpu",))
        fresh.quiet_pass(0.5)
    assert not fresh.rec.settled, "n1 may still be backing off: its retry comes within a heartbeat"
    fresh.report("n1")
    fresh.quiet_pass(3)
    fresh.report("n1")
    fresh.report("n2", pools=("cpu",))
    fresh.quiet_pass(5)
    assert fresh.rec.settled
    assert {r.spec.id for r in fresh.rec.replicas.values()} == set(w.rec.replicas), "both adopted, nothing new"
    assert all(r.adopted for r in fresh.rec.replicas.values()) and fresh.rec.unplaceable == {}


def test_settling_window_ends_on_time_without_reports():
    w = World(catalog(model("a")), settle=5)
    w.step(6)
    assert w.rec.settled


def test_ready_replica_becomes_an_endpoint_only_once_ready():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    w.step()
    w.agent_follows("n1", state="starting")
    w.step()
    assert w.rec.endpoints == ()
    w.agent_follows("n1", state="ready")
    (rid,) = w.rec.replicas
    w.running["n1"][rid]["state"] = "ready"
    w.report("n1")
    w.step()
    assert [e.replica_id for e in w.rec.endpoints] == [rid]
    assert w.sink.pushes[-1] == w.rec.endpoints
    pushes = len(w.sink.pushes)
    w.step()
    assert len(w.sink.pushes) == pushes, "an unchanged list must not be pushed again"


def test_restart_adopts_what_agents_run_and_starts_no_duplicate():
    w = World(catalog(model("a"), model("b")), settle=0)
    w.report("n1")
    converge(w)
    before = {r.spec.id: r.spec.spec_hash for r in w.rec.replicas.values()}
    assert len(before) == 2
    # A new controller: no records, a settling window, the same agents.
    fresh = World(w.live.current, settle=30)
    fresh.running = w.running
    fresh.quiet_pass(0)
    fresh.report("n1")
    fresh.quiet_pass()
    fresh.report("n1")
    fresh.quiet_pass(7)
    assert fresh.rec.settled
    assert {r.spec.id: r.spec.spec_hash for r in fresh.rec.replicas.values()} == before
    assert all(r.adopted for r in fresh.rec.replicas.values())
    assert {s.id for s in fresh.desired.get("n1")[1]} == set(before), "adopted replicas must stay desired"


def test_adoption_during_settling_answers_the_node_with_what_it_runs():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    converge(w)
    fresh = World(w.live.current, settle=30)
    fresh.running = w.running
    fresh.report("n1")
    fresh.quiet_pass()
    assert not fresh.rec.settled
    # An agent takes its first answer as the whole truth: it must list the adopted replica.
    assert [s.id for s in fresh.desired.get("n1")[1]] == list(w.rec.replicas)


def test_unknown_replica_of_a_model_no_longer_in_the_catalog_is_not_desired():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    converge(w)
    fresh = World(catalog(model("b")), settle=0)
    fresh.running = w.running
    fresh.report("n1")
    converge(fresh)
    assert [r.spec.model for r in fresh.rec.replicas.values()] == ["b"]
    assert [s.model for s in fresh.desired.get("n1")[1]] == ["b"]


def test_orphan_is_withdrawn_first_and_stopped_once_drained():
    w = World(catalog(model("a"), model("b")), settle=0)
    w.report("n1")
    converge(w)
    b = next(r for r in w.rec.replicas.values() if r.spec.model == "b")
    w.usage.snapshot = {b.spec.id: (w.clock.now, 2)}       # two requests in flight on it
    w.live.swap(catalog(model("a")))
    w.step()
    assert b.state == "draining"
    assert b.spec.id not in {e.replica_id for e in w.rec.endpoints}, "withdrawn from the router first"
    assert b.spec.id in {s.id for s in w.desired.get("n1")[1]}, "...but its engine keeps running while it drains"
    w.step(5)
    assert b.state == "draining"
    w.usage.snapshot = {b.spec.id: (w.clock.now, 0)}
    w.step()
    assert b.state == "stopping" and b.spec.id not in {s.id for s in w.desired.get("n1")[1]}
    w.agent_follows("n1")
    w.step()
    assert b.spec.id not in w.rec.replicas


def test_drain_is_bounded_by_the_grace_period():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    converge(w)
    (a,) = w.rec.replicas.values()
    w.usage.snapshot = {a.spec.id: (w.clock.now, 1)}        # a request that never finishes
    w.live.swap(catalog(model("b")))
    w.step()
    w.step(31)
    assert a.state == "stopping"


def test_changed_profile_surges_a_replacement_before_stopping_the_old_one():
    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    converge(w)
    (old,) = w.rec.replicas.values()
    w.live.swap(catalog(model("a", args="[--ttft, '0.1']")))
    w.step()
    new = [r for r in w.rec.replicas.values() if r is not old]
    assert len(new) == 1 and old.state == "ready", "surge: the new one first, the old one keeps serving"
    w.agent_follows("n1", state="starting")
    w.step()
    assert old.state == "ready"
    w.running["n1"][new[0].spec.id]["state"] = "ready"
    w.report("n1")
    w.step()
    assert old.state in ("draining", "stopping")


def test_idle_model_scales_to_min_and_zero_frees_it():
    w = World(catalog(model("a", replicas="{min: 0, max: 1}", idle="10m")), settle=0)
    w.report("n1")
    converge(w)
    assert w.rec.replicas == {}, "min 0 and never used: nothing runs"
    w.rec.wake("a")
    w.rec.wake("a")
    w.rec.wake("a")
    w.step()
    assert len(w.rec.replicas) == 1, "woken many times, it still starts one"
    converge(w)
    (a,) = w.rec.replicas.values()
    w.usage.snapshot = {a.spec.id: (w.clock.now, 0)}
    w.step(9 * 60)
    assert a.state == "ready"
    w.step(2 * 60)
    assert a.state in ("draining", "stopping")


def test_lost_node_leaves_the_router_at_once_and_its_only_replica_is_replaced_at_the_node_timeout():
    # Issue 15: a model left with nothing ready is replaced at once, not after
    # the grace (which still holds for a model served elsewhere: test_node_loss).
    w = World(catalog(model("a", pool="gpu")), settle=0)
    w.report("n1")
    w.report("n2")
    converge(w, nodes=("n1", "n2"))
    (a,) = w.rec.replicas.values()
    lost = a.node
    other = "n2" if lost == "n1" else "n1"
    w.alive.discard(lost)
    w.clock.now += 16
    w.agent_follows(other)          # the other node keeps reporting
    w.rec.reconcile_once()
    assert w.rec.endpoints == ()
    assert [r.node for r in w.rec.replicas.values()] == [other]
    # The lost node comes back still running the old replica, which is now
    # surplus: it is told to stop it, and the replacement stays.
    w.agent_follows(other)
    w.step()
    w.report(lost)
    w.step()
    assert w.desired.get(lost)[1] == ()
    assert [r.node for r in w.rec.replicas.values() if r.state == "ready"] == [other]


def test_unplaceable_model_gets_a_reason():
    w = World(catalog(model("huge", gpus=8)), settle=0)
    w.report("n1")
    w.step()
    assert "huge" in w.rec.unplaceable and w.rec.unplaceable["huge"]
    assert any(e.kind == "unplaceable" for e in w.rec.events)


@pytest.mark.parametrize("after", [None, 0, 999])
def test_desired_long_poll_answers_at_once_when_versions_differ(after):
    import asyncio

    store = DesiredStore(first_version=1)
    store.set("n1", ())

    async def go():
        return await store.wait("n1", after, timeout=5)

    version, specs = asyncio.run(go())
    assert version == 1 and specs == ()


def test_status_says_how_long_a_replica_has_been_loading_and_stops_once_ready():
    from llmgwctl.cli.status import render

    w = World(catalog(model("a")), settle=0)
    w.report("n1")
    w.step()
    w.agent_follows("n1", state="starting")
    w.step(40.0)
    (replica,) = w.rec.status()["replicas"]
    assert replica["state"] == "starting" and replica["starting_seconds"] == 40.0
    assert "starting 40s" in render(w.rec.status() | {"catalog": {"version": "v", "models": 1, "directory": "catalogs"}},
                                  now=w.clock.now)
    (rid,) = w.rec.replicas
    w.running["n1"][rid]["state"] = "ready"
    w.report("n1")
    w.step()
    (replica,) = w.rec.status()["replicas"]
    assert replica["state"] == "ready" and replica["starting_seconds"] is None
