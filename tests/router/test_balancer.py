"""The pick, on pure state: tiers, load per weight, staleness, ejection. No network, a fake clock."""
from __future__ import annotations

import collections
import random

import pytest

from llmgwctl.contracts import Endpoint, LoadReading
from llmgwctl.router.balancer import Balancer

from ..support import FakeClock


def ep(rid: str, model: str = "m", priority: int = 0, weight: float = 1.0, profile: str = "p",
       metrics: str | None = "/metrics") -> Endpoint:
    return Endpoint(replica_id=rid, model=model, profile=profile, engine="fake", url=f"http://127.0.0.1:{1000 + len(rid)}",
                    priority=priority, weight=weight, metrics_path=metrics)


def make(*eps: Endpoint, clock: FakeClock | None = None) -> tuple[Balancer, FakeClock]:
    clock = clock or FakeClock()
    b = Balancer(clock=clock, stale_after=3.0, rng=random.Random(7))
    b.set_endpoints(eps)
    return b, clock


def state(b: Balancer, rid: str):
    return next(s for s in b.states() if s.replica_id == rid)


def counts(b: Balancer, model: str = "m", n: int = 2000) -> collections.Counter:
    return collections.Counter(b.pick(model).replica_id for _ in range(n))


def test_unknown_model_or_no_endpoints_picks_nothing():
    b, _ = make(ep("a"))
    assert b.pick("other") is None
    b.set_endpoints([])
    assert b.pick("m") is None


def test_highest_priority_tier_takes_traffic_while_it_has_room():
    b, _ = make(ep("hi", priority=10), ep("lo", priority=1))
    assert set(counts(b)) == {"hi"}


def test_full_top_tier_spills_to_lower_tier_and_all_full_stays_on_top():
    b, clock = make(ep("hi", priority=10), ep("lo", priority=1))
    b.record(state(b, "hi"), LoadReading(running=256, waiting=3))
    assert set(counts(b)) == {"lo"}
    b.record(state(b, "lo"), LoadReading(running=4, waiting=0, kv_cache=0.99))
    # Nobody has room: the request queues at the best profile's engine.
    assert set(counts(b)) == {"hi"}


def test_least_loaded_wins_within_a_tier():
    b, _ = make(ep("a"), ep("b"))
    state(b, "a").inflight = 5
    assert counts(b) == {"b": 2000}


def test_engine_gauges_count_as_load():
    b, _ = make(ep("a"), ep("b"))
    b.record(state(b, "a"), LoadReading(running=10, waiting=0))
    b.record(state(b, "b"), LoadReading(running=1, waiting=0))
    assert counts(b) == {"b": 2000}


def test_weight_divides_load():
    b, _ = make(ep("heavy", weight=4), ep("light", weight=1))
    state(b, "heavy").inflight = 3     # 3/4 per unit of weight
    state(b, "light").inflight = 1     # 1/1
    assert counts(b) == {"heavy": 2000}


def test_weights_split_idle_endpoints_by_weight():
    # Sequential requests find every endpoint idle: each pick is a tie of load,
    # and the weights alone must decide it (3:1 here, not the coin toss it was).
    b, _ = make(ep("heavy", weight=3), ep("light", weight=1))
    for rid in ("heavy", "light"):
        b.record(state(b, rid), LoadReading(running=0, waiting=0))
    got = counts(b, n=4000)
    assert 2850 <= got["heavy"] <= 3150, got     # 3000 expected, sd 27


def test_weights_split_unknown_load_by_weight_and_three_ways():
    # No readings yet (every engine just joined): the same tie, the same split.
    b, _ = make(ep("a", weight=3), ep("b", weight=2), ep("c", weight=1))
    got = counts(b, n=6000)
    assert 2800 <= got["a"] <= 3200 and 1800 <= got["b"] <= 2200 and 800 <= got["c"] <= 1200, got


def test_weighted_unequal_load_still_goes_to_less_load_per_weight():
    b, _ = make(ep("heavy", weight=3), ep("light", weight=1))
    state(b, "heavy").inflight = 6      # 2 per unit of weight
    state(b, "light").inflight = 1      # 1 per unit
    assert counts(b) == {"light": 2000}


def test_equal_load_is_spread_not_herded():
    b, _ = make(ep("a"), ep("b"), ep("c"))
    got = counts(b, n=3000)
    assert set(got) == {"a", "b", "c"}
    assert min(got.values()) > 600


def test_stale_reading_is_unknown_not_idle():
    b, clock = make(ep("a"), ep("b"))
    b.record(state(b, "a"), LoadReading(running=0, waiting=0))
    b.record(state(b, "b"), LoadReading(running=0, waiting=0))
    clock.now += 10      # both stale now
    b.record(state(b, "a"), LoadReading(running=0, waiting=0))
    # b has no fresh reading: with equal in-flight, the known-idle a wins every time.
    assert counts(b) == {"a": 2000}
    # ...but a busy a loses to the unknown b, which still takes traffic.
    state(b, "a").inflight = 3
    assert counts(b) == {"b": 2000}


def test_stale_full_reading_no_longer_blocks_the_tier():
    b, clock = make(ep("hi", priority=10), ep("lo", priority=1))
    b.record(state(b, "hi"), LoadReading(running=256, waiting=9))
    assert set(counts(b, n=50)) == {"lo"}
    clock.now += 3.5
    assert set(counts(b, n=50)) == {"hi"}


# -- the engine's gauges against the router's own count (a reading is up to a poll old) -------

def test_a_full_reading_stops_blocking_once_our_own_requests_on_it_have_finished():
    b, _ = make(ep("hi", priority=10), ep("lo", priority=1))
    hi = state(b, "hi")
    for _ in range(5):
        b.started(hi)
    b.record(hi, LoadReading(running=4, waiting=1, kv_cache=1.0))     # all five are ours
    assert set(counts(b, n=50)) == {"lo"}
    b.finished(hi)
    b.finished(hi)
    # 3 of its 4 slots are taken now, though the reading (fresh) still says one waits.
    assert set(counts(b, n=50)) == {"hi"}


def test_our_own_count_reaching_the_slots_seen_full_is_full_before_the_engine_says_so():
    b, _ = make(ep("hi", priority=10), ep("lo", priority=1))
    hi = state(b, "hi")
    for _ in range(4):
        b.started(hi)
    b.record(hi, LoadReading(running=4, waiting=0, kv_cache=1.0))     # 4 slots, all taken
    for _ in range(3):
        b.finished(hi)
    b.record(hi, LoadReading(running=1, waiting=0, kv_cache=0.25))
    assert set(counts(b, n=50)) == {"hi"}
    for _ in range(3):
        b.started(hi)
    # The last reading said 1 running and nothing waiting; we have just sent 3 more.
    assert set(counts(b, n=50)) == {"lo"}


def test_more_running_than_the_slots_seen_full_forgets_them():
    b, _ = make(ep("hi", priority=10), ep("lo", priority=1))
    hi = state(b, "hi")
    b.record(hi, LoadReading(running=2, waiting=1))
    assert set(counts(b, n=50)) == {"lo"}
    b.record(hi, LoadReading(running=3, waiting=0))     # it held more than 2 after all
    assert set(counts(b, n=50)) == {"hi"}


def test_a_poll_old_count_of_requests_that_have_finished_is_not_load():
    b, _ = make(ep("a"), ep("b"))
    a = state(b, "a")
    for _ in range(3):
        b.started(a)
    b.record(a, LoadReading(running=3, waiting=0, kv_cache=0.9))
    b.record(state(b, "b"), LoadReading(running=0, waiting=0, kv_cache=0.0))
    for _ in range(3):
        b.finished(a)
    b.started(state(b, "b"))
    # a is idle now (its 3 were ours and are done), b has one: a wins every time.
    assert counts(b) == {"a": 2000}


def test_other_routers_requests_in_the_gauges_still_count():
    b, _ = make(ep("a"), ep("b"))
    a, bb = state(b, "a"), state(b, "b")
    b.started(a)
    b.record(a, LoadReading(running=4, waiting=2))      # 1 of ours, 5 of other routers'
    b.started(bb)
    b.started(bb)
    b.record(bb, LoadReading(running=2, waiting=0))
    assert counts(b) == {"b": 2000}
    b.finished(a)
    # Ours finished, the others' 5 are still what we know of: a is still full.
    b.set_endpoints([ep("a", priority=10), ep("b")])
    b.record(state(b, "a"), LoadReading(running=4, waiting=1))
    assert set(counts(b, n=50)) == {"b"}


def test_our_requests_that_finished_while_the_poll_was_out_are_not_taken_for_others():
    b, _ = make(ep("a"), ep("b"))
    a = state(b, "a")
    b.started(a)
    b.started(a)
    sent = a.inflight
    b.finished(a)
    b.finished(a)
    b.record(a, LoadReading(running=2, waiting=0), sent)     # the engine counted our 2
    b.record(state(b, "b"), LoadReading(running=0, waiting=0))
    b.started(state(b, "b"))
    assert counts(b) == {"a": 2000}


def test_endpoint_without_metrics_is_not_penalised_as_stale():
    b, _ = make(ep("a", metrics=None), ep("b"))
    b.record(state(b, "b"), LoadReading(running=0, waiting=0))
    got = counts(b)
    assert set(got) == {"a", "b"}


def test_ejection_grows_and_expires():
    b, clock = make(ep("a"), ep("b"))
    a = state(b, "a")
    assert b.eject(a) == 1.0
    assert set(counts(b, n=50)) == {"b"}
    clock.now += 1.01
    assert "a" in counts(b, n=200)
    assert b.eject(a) == 2.0
    assert b.eject(a) == 4.0
    for _ in range(10):
        b.eject(a)
    assert a.ejected_until - clock.now == 30.0
    b.succeeded(a)
    assert b.eject(a) == 1.0


def test_everything_ejected_still_picks_the_soonest_back():
    b, _ = make(ep("a"), ep("b"))
    b.eject(state(b, "a"))
    b.eject(state(b, "b"))
    b.eject(state(b, "b"))
    assert b.pick("m").replica_id == "a"


def test_exclude_skips_endpoints_already_tried():
    b, _ = make(ep("a"), ep("b"))
    a = state(b, "a")
    assert all(b.pick("m", (a,)).replica_id == "b" for _ in range(50))
    assert b.pick("m", (a, state(b, "b"))) is None


def test_a_request_started_and_finished_through_the_balancer_is_load_and_then_last_use():
    b, clock = make(ep("a"), ep("b"))
    a = state(b, "a")
    b.started(a)
    clock.now += 2.0
    b.started(a)
    assert b.usage_snapshot()["a"] == (1000.0 + 2.0, 2)
    assert b.pick("m").replica_id == "b"        # in flight is load: the idle peer wins
    clock.now += 3.0
    b.finished(a)
    b.finished(a)
    assert b.usage_snapshot() == {"a": (1005.0, 0), "b": (None, 0)}
    # Withdrawn while a request runs: still reported until it finishes.
    b.started(a)
    b.set_endpoints([ep("b")])
    assert b.usage_snapshot()["a"] == (1005.0, 1)
    b.finished(a)
    assert "a" not in b.usage_snapshot()


def test_set_endpoints_keeps_state_of_unchanged_ids_and_reports_new_models():
    b, clock = make(ep("a"), ep("b"))
    a = state(b, "a")
    a.inflight, a.last_used = 2, 5.0
    gained = b.set_endpoints([ep("a"), ep("c", model="n")])
    assert gained == {"n"}
    assert state(b, "a") is a
    assert b.usage_snapshot() == {"a": (5.0, 2), "c": (None, 0)}
    # Same id, new url (a restart): fresh counters, last use carried for the idle timeout.
    moved = Endpoint(replica_id="a", model="m", profile="p", engine="fake", url="http://127.0.0.1:9")
    b.set_endpoints([moved])
    assert b.usage_snapshot() == {"a": (5.0, 0)}
    assert b.has_profile("m", "p") and not b.has_profile("m", "q") and b.ready_count("m") == 1


def test_a_push_rebuilds_the_tiers_of_the_models_it_changed_and_keeps_the_others():
    """set_endpoints builds again only the models whose endpoints came, went or changed (issue 19)."""
    a1, a2, b1 = ep("a1", model="a"), ep("a2", model="a", priority=1), ep("b1", model="b")
    b, _ = make(a1, a2, b1)
    kept = state(b, "b1")
    moved = Endpoint(replica_id="a2", model="a", profile="p", engine="fake", url="http://127.0.0.1:9", priority=1)
    b2 = ep("b2", model="b", profile="q")
    assert b.set_endpoints([a1, moved, b1, b2]) == {"b"}, "a changed url is no gain; a new id is"
    assert state(b, "b1") is kept, "an endpoint handed again keeps its state"
    assert b.pick("a").endpoint.url == "http://127.0.0.1:9", "the higher tier holds the moved endpoint"
    assert b.ready_count("b") == 2 and b.has_profile("b", "q")
    b.set_endpoints([b1, b2, ep("c1", model="c")])
    assert b.pick("a") is None and b.ready_count("a") == 0 and not b.has_profile("a", "p"), "every endpoint of a left"
    assert b.pick("c").replica_id == "c1" and b.ready_count("b") == 2
    b.set_endpoints([ep("c1", model="c")])
    assert b.pick("b") is None and {st.replica_id for st in b.states()} == {"c1"}


def test_duplicate_replica_ids_are_refused():
    b, _ = make()
    with pytest.raises(ValueError, match="appears twice"):
        b.set_endpoints([ep("a"), ep("a")])


@pytest.mark.parametrize("kwargs, message", [
    ({"url": "127.0.0.1:80"}, "url must look like"),
    ({"url": "http://h:1/"}, "trailing"),
    ({"weight": 0}, "weight must be greater than 0"),
    ({"metrics_path": "metrics"}, "metrics_path must start"),
])
def test_bad_endpoints_say_what_is_wrong(kwargs, message):
    fields = dict(replica_id="r", model="m", profile="p", engine="fake", url="http://h:1")
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Endpoint(**fields)


def test_endpoint_dict_round_trip():
    e = ep("a", priority=3, weight=2.5)
    assert Endpoint.from_dict(e.to_dict()) == e
    with pytest.raises(ValueError, match="missing field 'url'"):
        Endpoint.from_dict({"replica_id": "x", "model": "m"})


def test_in_flight_is_integrated_over_time_for_the_autoscaler():
    """inflight_seconds: each request counted for as long as it is in flight, whatever a sample would catch."""
    b, clock = make(ep("a"), ep("b"))
    a = state(b, "a")
    b.started(a)
    clock.advance(0.5)
    b.started(a)                    # two in flight from 0.5 s
    clock.advance(0.25)
    b.finished(a)
    b.finished(a)                   # none from 0.75 s: a sample now says 0
    clock.advance(1.0)
    assert b.inflight_seconds() == {"a": pytest.approx(0.5 + 2 * 0.25), "b": 0.0}
    b.started(a)
    clock.advance(2.0)              # still running: the counter runs up to now
    assert b.inflight_seconds()["a"] == pytest.approx(3.0)
    # Withdrawn while the request runs: still counted until it ends, as the drain sees it.
    b.set_endpoints([ep("b")])
    clock.advance(1.0)
    assert b.inflight_seconds()["a"] == pytest.approx(4.0)
    b.finished(a)
    b.usage_snapshot()              # the snapshot lets a finished withdrawn endpoint go
    assert "a" not in b.inflight_seconds()
