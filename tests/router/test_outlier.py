"""Outlier ejection on missed polls (router/outlier.py, ejection.py): out after N in a row, back at an
answer once the back-off has run out, longer for each ejection that follows soon. Clock injected."""
from __future__ import annotations

from llmgwctl.contracts import Endpoint
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.ejection import Ejector
from llmgwctl.router.outlier import BASE, CAP, CODE, EJECT_AFTER, Outliers
from tests.support import FakeClock


def _setup():
    clock = FakeClock()
    balancer = Balancer(clock=clock)
    balancer.set_endpoints([Endpoint("r-1", "m", "p", "fake", "http://127.0.0.1:1"),
                            Endpoint("r-2", "m", "p", "fake", "http://127.0.0.1:2")])
    counted: list[str] = []
    ejector = Ejector(balancer, clock=clock, on_eject=counted.append)
    return clock, balancer, ejector, Outliers(balancer, ejector, clock=clock), counted


def _picks(balancer, n=100):
    return {balancer.pick("m").replica_id for _ in range(n)}


def _miss(clock, outliers, state, times):
    for _ in range(times):
        clock.advance(1.0)
        outliers.missed(state, "each timed out after 1 s", took=1.0)


def test_misses_in_a_row_eject_and_one_less_does_not():
    clock, balancer, ejector, outliers, counted = _setup()
    bad = balancer.state_of("r-1")
    _miss(clock, outliers, bad, EJECT_AFTER - 1)
    assert "r-1" in _picks(balancer, 200) and ejector.current() == {}
    _miss(clock, outliers, bad, 1)
    assert _picks(balancer) == {"r-2"}
    ejection = ejector.current()["r-1"]
    assert ejection.code == CODE and counted == [CODE]
    assert ejection.describe() == ("ejected by the router until it answers (at least 5 s): "
                                   "no answer to 3 health probes in 3 s (each timed out after 1 s)")


def test_an_answer_between_misses_starts_the_count_again():
    clock, balancer, ejector, outliers, _ = _setup()
    bad = balancer.state_of("r-1")
    for _ in range(5):
        _miss(clock, outliers, bad, EJECT_AFTER - 1)
        outliers.answered(bad)
    assert ejector.current() == {}


def test_a_silent_endpoint_stays_out_past_its_back_off_and_comes_back_at_its_first_answer():
    clock, balancer, ejector, outliers, _ = _setup()
    bad = balancer.state_of("r-1")
    _miss(clock, outliers, bad, EJECT_AFTER)
    _miss(clock, outliers, bad, 100)        # long past BASE, and still silent
    assert _picks(balancer) == {"r-2"} and "r-1" in ejector.current()
    outliers.answered(bad)
    assert ejector.current() == {}
    assert "r-1" in _picks(balancer, 200)


def test_an_answer_before_the_back_off_ran_out_waits_for_the_next_one_after():
    clock, balancer, ejector, outliers, _ = _setup()
    bad = balancer.state_of("r-1")
    _miss(clock, outliers, bad, EJECT_AFTER)
    clock.advance(BASE / 2)
    outliers.answered(bad)
    assert _picks(balancer) == {"r-2"}
    clock.advance(BASE / 2)
    outliers.answered(bad)
    assert "r-1" in _picks(balancer, 200)


def test_each_ejection_soon_after_the_last_doubles_the_back_off_up_to_the_cap_and_a_quiet_spell_resets():
    clock, balancer, ejector, outliers, _ = _setup()
    bad = balancer.state_of("r-1")
    seen = []
    for _ in range(7):
        _miss(clock, outliers, bad, EJECT_AFTER)
        seen.append(ejector.current()["r-1"].seconds)
        clock.advance(seen[-1])
        outliers.answered(bad)
        assert ejector.current() == {}
    assert seen == [5, 10, 20, 40, 80, 120, 120]
    clock.advance(CAP)
    _miss(clock, outliers, bad, EJECT_AFTER)
    assert ejector.current()["r-1"].seconds == BASE


def test_a_failed_request_while_held_does_not_let_it_back_early():
    clock, balancer, ejector, outliers, _ = _setup()
    bad = balancer.state_of("r-1")
    _miss(clock, outliers, bad, EJECT_AFTER)
    balancer.eject(bad)             # a connect failure's own short ejection moves the time it ends
    clock.advance(BASE + 1)
    _miss(clock, outliers, bad, 1)
    assert _picks(balancer) == {"r-2"}


def test_a_held_ejection_does_not_cut_short_a_timed_one_for_a_cause():
    clock, balancer, ejector, outliers, _ = _setup()
    bad = balancer.state_of("r-1")
    ejector.eject(bad, "answer_too_large", "answered 10 GB")        # 30 s
    _miss(clock, outliers, bad, EJECT_AFTER)
    clock.advance(BASE + 1)
    outliers.answered(bad)
    assert _picks(balancer) == {"r-2"}


def test_an_endpoint_that_left_is_forgotten():
    clock, balancer, ejector, outliers, _ = _setup()
    bad = balancer.state_of("r-1")
    _miss(clock, outliers, bad, EJECT_AFTER - 1)
    balancer.set_endpoints([Endpoint("r-1", "m", "p", "fake", "http://127.0.0.1:9"),     # back at a new URL
                            Endpoint("r-2", "m", "p", "fake", "http://127.0.0.1:2")])
    outliers.retain({"r-1", "r-2"})
    _miss(clock, outliers, balancer.state_of("r-1"), 1)
    assert ejector.current() == {}


def test_after_0_ejects_nothing_but_still_counts_the_silent():
    # --eject-after 0: the agents' probes alone withdraw a wedged replica; the router still knows
    # which endpoints are silent, so what waits on one withdrawn while silent moves (inflight.py).
    clock, balancer, ejector, _, counted = _setup()
    wedged: list[str] = []
    outliers = Outliers(balancer, ejector, clock=clock, after=0, on_wedged=lambda st, why: wedged.append(why))
    bad = balancer.state_of("r-1")
    _miss(clock, outliers, bad, 100)
    assert ejector.current() == {} and counted == [] and wedged == []
    assert _picks(balancer) == {"r-1", "r-2"}
    assert outliers.silent() == {"r-1": bad}
    outliers.answered(bad)
    assert outliers.silent() == {}
