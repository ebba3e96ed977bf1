"""Autoscaling on load: the policy's arithmetic alone, then the reconciler following it pass by pass.

Time is a FakeClock moved by the test; loads are what a router and its
engines would report. Nothing sleeps.
"""
import json

import pytest

from llmgwctl.catalog import Autoscale
from llmgwctl.contracts import LoadReading, UsageReport
from llmgwctl.control.usage import UsageBoard
from llmgwctl.reconciler.autoscale import Autoscaler, Signal, signal

from ..support import FakeClock
from .test_reconciler import World, catalog, converge

# No tolerance band here: the tests of the rules below see every step; the band has its own tests.
POLICY = Autoscale(metric="inflight", target=4, scale_down_window=30, fast_factor=2, max_step=2, tolerance=0).policy()


def decide(scaler, now, current, load, *, ready=None, starting=0, low=1, high=10, policy=POLICY):
    return scaler.decide(policy, now, current, Signal(load, current if ready is None else ready, starting), low, high)


# --- the policy alone --------------------------------------------------------------

def test_wanted_is_the_load_over_the_target_rounded_up_within_min_and_max():
    assert decide(Autoscaler(), 0, 3, 12).wanted == 3            # exactly at target: no change
    assert decide(Autoscaler(), 0, 3, 13).wanted == 4            # one request over: one replica more
    assert decide(Autoscaler(), 0, 3, 13).needed == 4
    assert decide(Autoscaler(), 0, 9, 70, high=10).wanted == 10  # never past max
    assert decide(Autoscaler(), 0, 1, 0.0, low=1).needed == 1    # never below min


def test_one_passing_burst_is_averaged_away():
    s = Autoscaler()
    assert decide(s, 0, 2, 4).wanted == 2
    assert decide(s, 1, 2, 4).wanted == 2
    assert decide(s, 2, 2, 13).wanted == 2, "mean of 4, 4, 13 is 7: 2 replicas of 4 are enough"
    assert decide(s, 3, 2, 13).wanted == 3, "mean of 4, 13, 13 is 10: needs 3"


def ramp(scaler, policy, until, *, cold_start, current=1, rate=0.4, start=0.5):
    """Passes every second of a load growing `rate` a second (time-averaged over each pass); the last decision."""
    d = None
    for t in range(until + 1):
        d = scaler.decide(policy, float(t), current, Signal(start + rate * t, current, span=1.0), 1, 10,
                          cold_start=cold_start)
        current = d.wanted
    return d


def test_a_step_on_a_ramp_is_sized_for_the_load_when_its_replicas_will_be_ready():
    policy = Autoscale(target=1.5, scale_down_window=20, tolerance=0.1).policy()
    # Growing 0.4/s: at t=4 the mean of the last 2 s is 1.9 on one replica -- the level needs 2.
    level = ramp(Autoscaler(), policy, 4, cold_start=0)
    assert (level.wanted, level.needed) == (2, 2)
    # With a 4 s cold start (+1 s of the mean's lag) the load will be 1.9 + 0.4 * 5 = 3.9 when a
    # replica placed now is ready: 3 are needed, and the one step buys them.
    d = ramp(Autoscaler(), policy, 4, cold_start=4)
    assert (d.wanted, d.needed) == (3, 3)
    assert "growing 0.4/s: 3.9 by the time a replica placed now is ready (5.0 s)" in d.reason


def test_the_growth_never_starts_a_step_and_a_flat_or_falling_load_plans_nothing():
    policy = Autoscale(target=1.5, scale_down_window=20, tolerance=0.1).policy()
    # Steeply growing but still under the target on 2 replicas: no step, however steep.
    d = ramp(Autoscaler(), policy, 5, cold_start=30, current=2, rate=0.2, start=0.1)
    assert d.wanted == 2 and d.reason == ""
    # Past the band on a flat load: the level's step, no more.
    s = Autoscaler()
    for t in range(10):
        d = s.decide(policy, float(t), 1, Signal(2.0, 1, span=1.0), 1, 10, cold_start=30)
    assert (d.wanted, d.needed) == (2, 2)
    s = Autoscaler()
    for t in range(10):                 # falling, but still over the band at the end
        d = s.decide(policy, float(t), 1, Signal(6.0 - 0.4 * t, 1, span=1.0), 1, 10, cold_start=30)
    assert d.needed == 2 and "growing" not in d.reason


def test_a_ramp_that_grows_while_a_step_starts_extends_the_step_before_the_level_would():
    """Flat when the level stepped (no growth to size it by), then growing: a step is extended while it starts."""
    policy = Autoscale(target=1.5, scale_down_window=20, tolerance=0.1).policy()

    def steps(starting_until_ready: bool) -> list[tuple[int, int]]:
        s, current, out = Autoscaler(), 1, []
        for t in range(10):
            load = 1.8 if t < 5 else 1.8 + 0.4 * (t - 4)
            # The one replica it started with is ready; the others are starting (or, to compare, ready).
            sig = Signal(load, 1 if starting_until_ready else current, current - 1 if starting_until_ready else 0,
                         span=1.0)
            d = s.decide(policy, float(t), current, sig, 1, 10, cold_start=4)
            if d.wanted != current:
                out.append((t, d.wanted))
            current = d.wanted
        return out

    # 1.8 on one replica: the level's step to 2, sized for no growth. From t=5 the load grows 0.4/s;
    # at t=7 the 2 s mean is 2.8 and the fitted growth 0.16/s: 3.6 a cold start from now, past 2 x 1.65.
    assert steps(True) == [(0, 2), (7, 3), (9, 4)]
    # The same loads with nothing starting: the growth starts no step; the level's comes at t=9
    # (3.6 on 2, past the band), two passes later.
    assert steps(False) == [(0, 2), (9, 4)]


def test_a_step_in_progress_is_not_extended_on_a_flat_or_falling_load_or_after_a_jump():
    policy = Autoscale(target=1.5, scale_down_window=20, tolerance=0.1).policy()
    for loads in ([3.0] * 10, [3.0 - 0.1 * t for t in range(10)]):
        s, current = Autoscaler(), 2
        for t, load in enumerate(loads):
            d = s.decide(policy, float(t), current, Signal(load, 1, current - 1, span=1.0), 1, 10, cold_start=4)
            current = d.wanted
        assert current == 2, loads
    # A jump from 0.5 to 3 and flat after it: the level steps to 3 (its growth sized by the jump).
    # The 2 s mean and the fitted slope go on rising for seconds after, but the load itself has
    # not grown since the step was taken on it: nothing more.
    s, current, steps = Autoscaler(), 1, []
    for t in range(12):
        d = s.decide(policy, float(t), current, Signal(0.5 if t < 4 else 3.0, 1, current - 1, span=1.0), 1, 10,
                     cold_start=4)
        if d.wanted != current:
            steps.append((t, d.wanted))
        current = d.wanted
    assert steps == [(4, 3)]


def test_the_reconciler_measures_each_models_cold_start_from_placement_to_ready():
    w = World(scaled(), settle=0)
    w.report("n1")
    def all_ready():
        for rep in w.running["n1"].values():
            rep["state"] = "ready"
        w.report("n1")

    w.step()                                # placed
    w.agent_follows("n1", state="starting")
    for _ in range(5):
        w.step()
    all_ready()                             # ready 6 s after it was placed
    w.step()
    assert w.rec.scaling.scales["a"].cold_start == 6.0
    under(w, 7)                             # the second replica: placed, then ready 2 s later
    w.agent_follows("n1", state="starting")
    w.step()
    all_ready()
    w.step()
    second = max(w.rec.replicas.values(), key=lambda r: r.created)
    assert count(w) == 2 and w.rec.scaling.scales["a"].cold_start == (6.0 + second.ready_since - second.created) / 2


def test_no_reading_holds_the_count():
    d = decide(Autoscaler(), 0, 3, None)
    assert (d.wanted, d.needed, d.reason) == (3, None, "")


def test_a_normal_step_is_bounded_and_starting_replicas_count_as_capacity():
    s = Autoscaler()
    d = decide(s, 0, 2, 14)         # needs 4, 1.75x the target per replica: the normal path
    assert d.wanted == 4 and "needs 4" in d.reason
    d = decide(Autoscaler(), 0, 2, 15.9, policy=Autoscale(target=4, max_step=1, fast_factor=3, tolerance=0).policy())
    assert d.wanted == 3 and "a step of at most 1" in d.reason
    # The step's replicas are still starting: they count as capacity, so the
    # same load measured on the old replicas asks for nothing more.
    d = decide(s, 1, 4, 15, ready=2, starting=2)
    assert d.wanted == 4 and d.reason == ""
    # A load that grew past them steps again without waiting for them to be
    # ready: on a ramp, a cold start per step is what left replicas queueing.
    d = decide(s, 2, 4, 20, ready=2, starting=2)
    assert d.wanted == 5 and "needs 5" in d.reason


def test_inside_the_tolerance_band_nothing_changes_either_way():
    policy = Autoscale(target=4, scale_down_window=0, tolerance=0.1).policy()
    s = Autoscaler()
    # 3 replicas sized for 12: 13.2 is 1.1x the target per replica, on the band's edge.
    assert decide(s, 0, 3, 13.2, policy=policy).wanted == 3
    assert decide(s, 1, 3, 13.2, policy=policy).needed == 4, "the load alone would need a fourth"
    # Past the band, the step is the one the load needs.
    d = decide(Autoscaler(), 0, 3, 13.3, policy=policy)
    assert d.wanted == 4 and "needs 4" in d.reason
    # Down: 20 replicas sized for 80; 75.9 needs only 19,
    # 0.95x the target each: inside the band, the 20 stay (the window is 0 here).
    assert decide(Autoscaler(), 0, 20, 75.9, high=20, policy=policy).wanted == 20
    assert decide(Autoscaler(), 0, 20, 71.9, high=20, policy=policy).wanted == 18, "0.9x: outside the band"


def test_the_band_stops_the_flap_a_burst_causes_right_after_a_down_step():
    """Issue 17's bench: in the tail at a tenth of the target, a short burst asked a second replica
    right after the window took the fleet down to one. With the band, a burst within a tenth of
    the target per replica buys nothing; one past it still does."""
    policy = Autoscale(target=1.5, scale_down_window=20, tolerance=0.1).policy()
    clock = FakeClock()
    s = Autoscaler()
    wanted = 3
    for _ in range(25):                   # quiet: the window takes the fleet down to one
        wanted = s.decide(policy, clock.now, wanted, Signal(0.4, wanted), 1, 6).wanted
        clock.advance(1)
    assert wanted == 1
    for load in (1.6, 1.6, 1.6, 0.4):     # a 3 s burst: mean 1.6, 1.07x the target on one replica
        wanted = s.decide(policy, clock.now, wanted, Signal(load, 1), 1, 6).wanted
        clock.advance(1)
        assert wanted == 1, "within the band: no up-step after the down-step"
    for load in (2.0, 2.0, 2.0):          # mean reaches 2.0: 1.33x, past the band
        wanted = s.decide(policy, clock.now, wanted, Signal(load, 1), 1, 6).wanted
        clock.advance(1)
    assert wanted == 2


def test_the_band_does_not_hold_a_count_outside_min_and_max():
    policy = Autoscale(target=4, tolerance=0.5).policy()
    assert decide(Autoscaler(), 0, 1, 4.0, low=2, policy=policy).wanted == 2, "min raised under the count"


def test_the_fast_path_jumps_to_the_needed_count_even_while_replicas_start():
    s = Autoscaler()
    d = decide(s, 0, 2, 40, ready=1, starting=1)   # 20 per wanted replica, 5x the target
    assert d.wanted == 10 and "fast path" in d.reason


def test_scale_down_waits_a_whole_window_and_takes_its_highest_need():
    s = Autoscaler()
    assert decide(s, 0, 4, 16).wanted == 4
    assert decide(s, 10, 4, 2).wanted == 4, "watched for 10 s of a 30 s window: too soon"
    assert decide(s, 20, 4, 9).wanted == 4
    # At 30 s the window [0, 30] still holds the 16 at t=0: 4 were needed.
    assert decide(s, 30, 4, 2).wanted == 4
    # At 31 s the window holds needs of 1 (t=10), 3 (t=20), 1, 1: the highest is 3.
    d = decide(s, 31, 4, 2)
    assert d.wanted == 3 and "at most 3 needed throughout the last 30s" in d.reason
    assert decide(s, 51, 3, 2).wanted == 1, "the 3 left the window: down the rest, max_step 2 at a time"


def test_a_down_step_is_at_most_max_step():
    s = Autoscaler()
    decide(s, 0, 8, 0)
    assert decide(s, 30, 8, 0).wanted == 6


def test_a_spike_inside_the_window_keeps_the_replicas():
    s = Autoscaler()
    for t in range(0, 100, 5):
        load = 16 if t % 25 == 0 else 1
        assert decide(s, t, 4, load).wanted == 4, f"at {t}: a spike every 25 s is inside every 30 s window"


def test_reset_forgets_the_history():
    s = Autoscaler()
    decide(s, 0, 4, 16)
    s.reset()
    decide(s, 100, 4, 0)
    assert decide(s, 129, 4, 0).wanted == 4 and decide(s, 131, 4, 0).wanted == 2


def test_signal_per_metric():
    inflight = {"a": 3, "b": 5, "c": 7}
    loads = {"a": LoadReading(2, 1, 0.5), "b": LoadReading(5, 3, None)}
    assert signal("inflight", ["a", "b"], 1, inflight, loads) == Signal(8.0, 2, 1)   # c is not ready
    assert signal("waiting", ["a", "b"], 0, inflight, loads).load == 4.0
    assert signal("kv_cache", ["a", "b"], 0, inflight, loads).load == 0.5            # b reports no KV
    assert signal("kv_cache", ["b"], 0, inflight, loads).load is None
    assert signal("waiting", ["c"], 0, inflight, loads).load is None                 # no reading: unknown
    assert signal("inflight", [], 2, inflight, loads) == Signal(None, 0, 2)


# --- the contract: engine gauges travel with usage --------------------------------------

def test_usage_reports_carry_engine_readings_and_old_reports_still_parse():
    report = UsageReport.of("r", 3, {"x": (90.0, 2), "y": (None, 0)}, now=100.0, loads={"x": LoadReading(2, 1, 0.25)})
    wire = json.loads(json.dumps(report.to_dict()))
    assert wire["replicas"]["x"]["load"] == {"running": 2, "waiting": 1, "kv_cache": 0.25}
    assert "load" not in wire["replicas"]["y"]
    back = UsageReport.from_dict(wire)
    assert back.loads() == {"x": LoadReading(2.0, 1.0, 0.25)}
    old = UsageReport.from_dict({"router": "r", "version": 1, "replicas": {"x": {"idle_seconds": 1, "inflight": 1}}})
    assert old.loads() == {}


@pytest.mark.parametrize("load", [{"running": -1, "waiting": 0}, {"running": 1, "waiting": 1e300},
                                  {"running": 1, "waiting": 0, "kv_cache": 2}, {"running": "1", "waiting": 0}, [1]])
def test_a_broken_reading_is_refused(load):
    from llmgwctl.contracts import UsageError
    with pytest.raises(UsageError):
        UsageReport.from_dict({"router": "r", "version": 1,
                               "replicas": {"x": {"idle_seconds": 1, "inflight": 1, "load": load}}})


def test_the_board_merges_local_and_standalone_readings_and_forgets_silent_routers():
    class Local:
        def usage_snapshot(self):
            return {"a": (1.0, 1)}

        def load_snapshot(self):
            return {"a": LoadReading(1, 0, 0.1)}

    clock = FakeClock(100.0)
    report = {"router": "s", "version": 1, "replicas": {
        "a": {"idle_seconds": 0, "inflight": 1, "load": {"running": 9, "waiting": 9, "kv_cache": 0.9}},
        "b": {"idle_seconds": 0, "inflight": 3, "load": {"running": 3, "waiting": 2, "kv_cache": 0.3}}}}
    board = UsageBoard(Local(), version=lambda: 1, clock=clock)
    board.report(report)
    # With an in-process router reading every engine, a standalone router's relayed gauges are not
    # taken: the controller could not check them (control.usage), and it reads the engines itself.
    assert board.load_snapshot() == {"a": LoadReading(1, 0, 0.1)}
    # Without one, the standalone routers' readings are merged, and forgotten with their routers.
    remote_only = UsageBoard(version=lambda: 1, clock=clock)
    remote_only.report(report)
    assert remote_only.load_snapshot() == {"a": LoadReading(9.0, 9.0, 0.9), "b": LoadReading(3.0, 2.0, 0.3)}
    clock.advance(7)
    assert board.load_snapshot() == {"a": LoadReading(1, 0, 0.1)}
    assert remote_only.load_snapshot() == {}


def test_usage_reports_carry_in_flight_counters_and_old_reports_still_parse():
    report = UsageReport.of("r", 3, {"x": (90.0, 2), "y": (None, 0)}, now=100.0, inflight_seconds={"x": 12.3456})
    wire = json.loads(json.dumps(report.to_dict()))
    assert wire["replicas"]["x"]["inflight_seconds"] == 12.346
    assert "inflight_seconds" not in wire["replicas"]["y"]
    assert UsageReport.from_dict(wire).replicas["x"].inflight_seconds == 12.346
    old = UsageReport.from_dict({"router": "r", "version": 1, "replicas": {"x": {"idle_seconds": 1, "inflight": 1}}})
    assert old.replicas["x"].inflight_seconds is None
    from llmgwctl.contracts import UsageError
    for bad in (-1, "3", True, float("nan")):
        with pytest.raises(UsageError):
            UsageReport.from_dict({"router": "r", "version": 1,
                                   "replicas": {"x": {"idle_seconds": 1, "inflight": 1, "inflight_seconds": bad}}})


def test_the_board_adds_up_in_flight_counters_without_jumps_as_routers_come_and_go():
    class Local:
        busy = {"a": 5.0}

        def usage_snapshot(self):
            return {"a": (1.0, 1)}

        def inflight_seconds(self):
            return dict(self.busy)

    def report(router, **replicas):
        board.report({"router": router, "version": 1, "replicas": {
            rid: {"idle_seconds": 0, "inflight": n, **({"inflight_seconds": c} if c is not None else {})}
            for rid, (n, c) in replicas.items()}})

    clock = FakeClock(100.0)
    local = Local()
    board = UsageBoard(local, version=lambda: 1, clock=clock)
    assert board.inflight_seconds() == {"a": 5.0}
    report("s", a=(1, 1000.0))              # a router that ran long before: its first report adds nothing
    assert board.inflight_seconds() == {"a": 5.0}
    clock.advance(2)
    local.busy = {"a": 7.0}
    report("s", a=(1, 1003.0), b=(2, 40.0))  # grew by 3; b is new to the board: nothing yet
    assert board.inflight_seconds() == {"a": 10.0, "b": 0.0}
    report("old", a=(2, None))              # a router from before the counter: its samples, held
    clock.advance(2)
    report("old", a=(4, None))
    assert board.inflight_seconds()["a"] == 7.0 + 3.0 + 4 * 2
    clock.advance(7)                        # both routers go silent: what they added stays
    assert board.inflight_seconds() == {"a": 18.0}, "no drop when a router goes stale; b is no longer listed"


def test_a_local_source_without_counters_is_integrated_from_its_samples():
    class Local:
        n = 2

        def usage_snapshot(self):
            return {"a": (1.0, self.n)}

    clock = FakeClock(100.0)
    local = Local()
    board = UsageBoard(local, clock=clock)
    assert board.inflight_seconds() == {"a": 0.0}
    clock.advance(1.5)
    local.n = 0
    assert board.inflight_seconds() == {"a": 3.0}
    clock.advance(1.0)
    assert board.inflight_seconds() == {"a": 3.0}


def test_a_time_averaged_load_is_the_signal_and_weighs_what_it_spans():
    # 6 request-seconds over 1.5 s: 4 in flight on average, whatever a sample would have caught.
    assert signal("inflight", ["a"], 0, {"a": 0}, {}, (6.0, 1.5)) == Signal(4.0, 1, 0, span=1.5)
    assert signal("inflight", ["a"], 0, {"a": 3}, {}, None).load == 3.0, "no counters: the sample"
    s = Autoscaler()
    policy = Autoscale(target=4, tolerance=0).policy()
    s.decide(policy, 0.0, 1, Signal(2.0, 1, span=1.9), 1, 10)
    # A woken pass 0.1 s later with a burst: it weighs 0.1 s of the mean, not half of it.
    d = s.decide(policy, 0.1, 1, Signal(40.0, 1, span=0.1), 1, 10)
    assert d.load == pytest.approx((2.0 * 1.9 + 40.0 * 0.1) / 2.0) and d.wanted == 1


def test_the_reconciler_scales_on_the_routers_counters_when_it_has_them():
    class Counters:
        busy: dict = {}

        def inflight_seconds(self):
            return dict(self.busy)

    w = World(scaled(max_=2), settle=0)     # max 2: the step's size is another test's (the growth)
    w.rec.concurrency = counters = Counters()
    w.report("n1")
    converge(w)
    (rid,) = [r.spec.id for r in w.rec.replicas.values()]
    total = 0.0
    for _ in range(4):
        # Every pass the router's sample says 0 in flight (it read between
        # requests), but its counter grew by 7 request-seconds a second.
        load_on(w, 0)
        total += 7.0
        counters.busy = {rid: total}
        w.step()
    assert count(w) == 2
    (event,) = [e for e in w.rec.events if e.kind == "scale-up"]
    assert "inflight 7 on 1 ready replica" in event.message


# --- the reconciler following the policy --------------------------------------------

def scaled(max_=8, **policy):
    block = ", ".join(f"{k}: {v}" for k, v in {"target": 4, "scale_down_window": "30s", **policy}.items())
    return catalog(f"  - name: a\n    replicas: {{min: 1, max: {max_}}}\n    autoscale: {{{block}}}\n"
                   "    profiles: [{name: p, engine: fake, gpus: 0}]\n")


def load_on(world, per_replica):
    """Every ready replica of `a` carries `per_replica` requests in flight, as the router counts them."""
    world.usage.snapshot = {r.spec.id: (world.clock.now, per_replica)
                            for r in world.rec.replicas.values() if r.state == "ready"}


def load_total(world, total):
    """`total` requests in flight on `a`, spread over its ready replicas as the balancer would."""
    ready = sorted(r.spec.id for r in world.rec.replicas.values() if r.state == "ready")
    world.usage.snapshot = {rid: (world.clock.now, total // len(ready) + (i < total % len(ready)))
                            for i, rid in enumerate(ready)}


def under(world, per_replica, passes=3):
    """`passes` passes with `per_replica` in flight on every ready replica: the policy averages 3 s of them."""
    for _ in range(passes):
        load_on(world, per_replica)
        world.step()


def level_only(world):
    """Forget the measured cold start: steps are sized for the load as it is (the growth has its own tests)."""
    world.rec.scaling.scales["a"].cold_start = 0.0


def count(world):
    return len([r for r in world.rec.replicas.values() if r.state not in ("draining", "stopping")])


def test_load_scales_a_model_up_to_what_it_needs_and_starting_replicas_ask_for_no_more():
    w = World(scaled(), settle=0)
    w.report("n1")
    converge(w)
    level_only(w)
    assert count(w) == 1
    under(w, 7)                             # 7 in flight, target 4: needs 2 (normal path, 1.75x)
    assert count(w) == 2 and w.rec.scaling.scales["a"].wanted == 2
    (event,) = [e for e in w.rec.events if e.kind == "scale-up"]
    assert "1 -> 2 replicas (inflight 4.67 on 1 ready replica (target 4 each) needs 2)" in event.message, \
        "stepped on the mean of the last 3 s (0, 7, 7), not on one pass"
    # The new replica is starting and the load grows on the old one: 11 needs
    # 3, the starting one counts, so one more is asked -- and no more, however
    # long the cold start takes.
    under(w, 11, passes=10)
    assert count(w) == 3, "a slow cold start must not trigger more and more replicas"
    w.agent_follows("n1")                   # the second replica is ready now
    for _ in range(5):                      # 14 in flight over the ready replicas: needs 4
        level_only(w)                       # (the starts that end are timed)
        load_total(w, 14)
        w.step()
        w.agent_follows("n1")
    assert count(w) == 4
    status = w.rec.fleet_status().models[0]
    assert (status.metric, status.target, status.load, status.needed, status.desired) == ("inflight", 4, 14, 4, 4)


def test_while_a_step_starts_a_load_a_whole_step_larger_steps_again():
    w = World(scaled(), settle=0)
    w.report("n1")
    converge(w)
    level_only(w)
    under(w, 7)
    assert count(w) == 2
    under(w, 15)                            # needs 4: two more than the 2 wanted, max_step 2
    assert count(w) == 4


def test_far_above_target_the_fast_path_goes_straight_to_the_count():
    w = World(scaled(max_step=1), settle=0)
    w.report("n1")
    converge(w)
    level_only(w)
    under(w, 0)
    under(w, 24, passes=1)                  # the mean of 0, 0, 24 is 8 on one replica: needs 2, 2x the target
    assert count(w) == 2
    under(w, 36, passes=1)                  # mean 20 over 2 wanted: needs 5, 2.5x: past max_step 1 at once
    assert count(w) == 5
    assert [e.message for e in w.rec.events if e.kind == "scale-up"][-1].endswith(
        "needs 5; fast path: 2.5x the target per wanted replica, at least 2x)")


def grow(world, per_replica, rounds=10):
    """Load on every ready replica while the agent starts what is asked, until the count settles."""
    for _ in range(rounds):
        load_on(world, per_replica)
        world.step()
        world.agent_follows("n1")


def test_after_the_window_below_target_the_model_scales_back_down_without_flapping():
    w = World(scaled(), settle=0)
    w.report("n1")
    converge(w)
    grow(w, 30)
    assert count(w) == 8
    for _ in range(25):                     # quieter, but within the 30 s window: all 8 stay
        load_total(w, 7)
        w.step()
        w.agent_follows("n1")
    assert count(w) == 8
    for _ in range(15):
        load_total(w, 7)
        w.step()
        w.agent_follows("n1")
    assert count(w) < 8
    downs = [e.message for e in w.rec.events if e.kind == "scale-down"]
    assert downs and "needed throughout the last 30s" in downs[0]
    for _ in range(60):
        load_total(w, 7)
        w.step()
        w.agent_follows("n1")
    assert count(w) == 2, "7 in flight at a target of 4 needs 2"
    events = list(w.rec.events)
    first_down = next(i for i, e in enumerate(events) if e.kind == "scale-down")
    assert not [e for e in events[first_down:] if e.kind == "scale-up"], "no up-step after the down-steps"


def test_idle_timeout_still_scales_to_zero_under_a_policy():
    w = World(catalog("  - name: a\n    replicas: {min: 0, max: 4}\n    idle_timeout: 10m\n"
                      "    autoscale: {target: 4, scale_down_window: 30s}\n"
                      "    profiles: [{name: p, engine: fake, gpus: 0}]\n"), settle=0)
    w.report("n1")
    w.rec.wake("a")
    converge(w)
    assert count(w) == 1
    load_on(w, 0)
    for _ in range(60):
        w.step()
    assert count(w) == 1, "in use and quiet: one replica stays until the idle timeout"
    w.step(11 * 60)
    assert count(w) == 0


def test_the_router_offers_only_fresh_readings():
    from llmgwctl.contracts import Endpoint
    from llmgwctl.router.balancer import Balancer

    clock = FakeClock()
    b = Balancer(clock=clock, stale_after=3.0)
    b.set_endpoints([Endpoint("r1", "m", "p", "fake", "http://127.0.0.1:1"),
                     Endpoint("r2", "m", "p", "fake", "http://127.0.0.1:2")])
    r1, r2 = b.states()
    b.record(r1, LoadReading(1, 2, 0.5))
    assert b.load_snapshot() == {"r1": LoadReading(1, 2, 0.5)}
    clock.advance(4)
    assert b.load_snapshot() == {}, "a reading older than stale_after is unknown, not idle"


def test_a_changed_policy_takes_effect_on_the_next_pass():
    # The reconciler keeps each model's resolved policy while the catalog's block is the same
    # object (issue 19): a swapped-in block must replace it, or the old target would go on.
    w = World(scaled(), settle=0)
    w.report("n1")
    converge(w)
    level_only(w)
    under(w, 3)                             # 3 in flight, target 4: one replica is enough
    assert count(w) == 1
    w.live.swap(scaled(target=2))           # the same load now needs 2
    under(w, 3)
    assert count(w) == 2 and w.rec.scaling.scales["a"].policy.target == 2
    (event,) = [e for e in w.rec.events if e.kind == "scale-up"]
    assert "target 2 each" in event.message


def test_counters_that_did_not_move_are_no_load_not_no_reading():
    # Unchanged counters are skipped as a whole (issue 19); that is a time-average of 0, and the
    # router's one sample (7 in flight) must not stand in for it as if there were no counters.
    class Counters:
        busy: dict = {}

        def inflight_seconds(self):
            return dict(self.busy)

    w = World(scaled(), settle=0)
    w.rec.concurrency = counters = Counters()
    w.report("n1")
    converge(w)
    level_only(w)
    (rid,) = [r.spec.id for r in w.rec.replicas.values()]
    counters.busy = {rid: 100.0}
    under(w, 7, passes=5)
    assert count(w) == 1 and w.rec.scaling.scales["a"].load == 0.0
    counters.busy = {rid: 107.0}            # and once they move, the growth is the load
    under(w, 7, passes=1)
    assert w.rec.scaling.scales["a"].load == 3.5    # the mean of this pass's 7 and the last one's 0
