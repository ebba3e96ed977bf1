"""The one retry schedule: exponential ceilings, full jitter under them, and when it starts over."""
import pytest

from llmgwctl.backoff import Backoff

from .support import FakeClock


def test_ceilings_double_to_the_cap_and_the_delay_is_drawn_below_them():
    draws = iter([0.0, 0.5, 0.999, 0.25, 0.5])
    b = Backoff(initial=1, cap=4, random=lambda: next(draws))
    assert [b.ceiling(n) for n in (1, 2, 3, 4, 10)] == [1, 2, 4, 4, 4]
    # Full jitter: delay = ceiling * (1 - u), u in [0, 1): never past the ceiling, never below zero.
    assert [b.failure() for _ in range(5)] == pytest.approx([1.0, 1.0, 4 * 0.001, 3.0, 2.0])
    assert b.failures == 5


def test_jitter_spreads_a_fleet_that_failed_at_the_same_moment():
    # A hundred agents losing the controller together: with the real random
    # source their first retries differ, instead of all landing at one instant.
    fleet = [Backoff(initial=1, cap=30) for _ in range(100)]
    first = [b.failure() for b in fleet]
    assert all(0 < d <= 1 for d in first)
    assert len(set(first)) > 90


def test_no_jitter_keeps_the_schedule_exact_and_partial_jitter_keeps_a_floor():
    exact = Backoff(initial=0.5, cap=15, jitter=0.0, random=lambda: 0.9)
    assert [exact.failure() for _ in range(7)] == [0.5, 1, 2, 4, 8, 15, 15]
    half = Backoff(initial=2, cap=8, jitter=0.5, random=lambda: 0.999999)
    assert half.failure() == pytest.approx(1.0, abs=1e-5)     # never below half the ceiling
    with pytest.raises(ValueError):
        Backoff(initial=1, cap=2, jitter=1.5)


def test_reset_and_reset_after_time_spent_ready():
    clock = FakeClock()
    b = Backoff(initial=1, cap=60, reset_after=300, jitter=0.0, clock=clock)
    assert [b.failure() for _ in range(3)] == [1, 2, 4]
    b.ready()
    clock.advance(299)
    assert b.failure() == 8          # not ready long enough: still growing
    b.ready()
    clock.advance(300)
    assert b.failure() == 1          # ran long enough: a fresh start
    b.reset()
    assert b.failures == 0 and b.failure() == 1
    # Without reset_after, time spent ready never resets: only reset() does.
    c = Backoff(initial=1, cap=60, jitter=0.0, clock=clock)
    c.failure()
    c.ready()
    clock.advance(10_000)
    assert c.failure() == 2
