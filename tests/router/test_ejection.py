"""Ejection for a cause (router/ejection.py): out of picks for a while, longer while it repeats, with its reason."""
from __future__ import annotations

from llmgwctl.contracts import Endpoint
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.ejection import BASE, CAP, Ejector
from tests.support import FakeClock


def _setup():
    clock = FakeClock()
    balancer = Balancer(clock=clock)
    balancer.set_endpoints([Endpoint("r-1", "m", "p", "fake", "http://127.0.0.1:1"),
                            Endpoint("r-2", "m", "p", "fake", "http://127.0.0.1:2")])
    return clock, balancer, Ejector(balancer, clock=clock)


def test_an_ejected_endpoint_is_not_picked_until_its_time_runs_out():
    clock, balancer, ejector = _setup()
    bad = balancer.state_of("r-1")
    ejection = ejector.eject(bad, "answer_too_large", "answered 10000000000 bytes")
    assert ejection.seconds == BASE
    assert {balancer.pick("m").replica_id for _ in range(50)} == {"r-2"}
    assert ejector.current()["r-1"].describe() == "ejected by the router for 30 s: answered 10000000000 bytes"
    clock.advance(BASE)
    assert "r-1" not in ejector.current()
    assert "r-1" in {balancer.pick("m").replica_id for _ in range(200)}


def test_repeating_doubles_up_to_the_cap_and_a_long_good_spell_starts_afresh():
    clock, balancer, ejector = _setup()
    bad = balancer.state_of("r-1")
    seen = []
    for _ in range(8):
        seen.append(ejector.eject(bad, "redirect", "answered 302").seconds)
        clock.advance(seen[-1] + 1)
    assert seen == [30, 60, 120, 240, 480, 600, 600, 600]
    clock.advance(CAP)
    assert ejector.eject(bad, "redirect", "answered 302").seconds == BASE


def test_an_endpoint_that_left_or_came_back_anew_is_not_shown_ejected():
    clock, balancer, ejector = _setup()
    ejector.eject(balancer.state_of("r-1"), "redirect", "answered 302")
    balancer.set_endpoints([Endpoint("r-1", "m", "p", "fake", "http://127.0.0.1:9"),     # restarted at a new URL
                            Endpoint("r-2", "m", "p", "fake", "http://127.0.0.1:2")])
    assert ejector.current() == {}
