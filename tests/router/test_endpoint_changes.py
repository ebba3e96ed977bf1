"""A router told what changed (`change_endpoints`) ends where one told the whole list (`set_endpoints`) does.

The in-process controller pushes changes only (issue 19); a standalone router
and every earlier push took the whole list. Any sequence of lists, pushed
both ways, must leave the same endpoints, tiers, profiles, metric slots and
refusals of unusable URLs.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgwctl.contracts import Endpoint
from llmgwctl.router import Router, RouterConfig

IDS = [f"r{i}" for i in range(8)]


def endpoint(rid: str, model: int, priority: int, port: int, profile: int) -> Endpoint:
    # port 0 is a URL no request could go to: the router leaves such an endpoint out.
    url = f"http://127.0.0.1:{20000 + port}" if port else "http://127.0.0.1:99999"
    return Endpoint(replica_id=rid, model=f"m{model}", profile=f"p{profile}", engine="fake", url=url,
                    priority=priority, metrics_path=None)


a_list = st.dictionaries(st.sampled_from(IDS), st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(0, 2),
                                                         st.integers(0, 1)))


def as_endpoints(listed: dict) -> tuple[Endpoint, ...]:
    return tuple(endpoint(rid, *fields) for rid, fields in sorted(listed.items()))


def changes(before: tuple[Endpoint, ...], after: tuple[Endpoint, ...]) -> dict[str, Endpoint | None]:
    old = {e.replica_id: e for e in before}
    new = {e.replica_id: e for e in after}
    out: dict[str, Endpoint | None] = {rid: None for rid in old.keys() - new.keys()}
    out.update({rid: e for rid, e in new.items() if old.get(rid) != e})
    return out


def seen(router: Router) -> dict:
    b = router.balancer
    models = {st.endpoint.model for st in b.states()} | {f"m{i}" for i in range(3)}
    return {
        "endpoints": {st.replica_id: st.endpoint for st in b.states()},
        "tiers": {m: [sorted(s.replica_id for s in tier) for tier in b._tiers.get(m, ())] for m in models},
        "profiles": {m: sorted(p for p in ("p0", "p1") if b.has_profile(m, p)) for m in models},
        "slots": {rid: router.metrics.slots.label(rid) for rid in IDS if router.metrics.slots.current(rid)},
        "refused": dict(router._bad_urls),
    }


@settings(max_examples=150, deadline=None)
@given(st.lists(a_list, min_size=1, max_size=8))
def test_changes_pushed_end_where_whole_lists_pushed_do(lists):
    told, changed = Router(config=RouterConfig()), Router(config=RouterConfig())
    last: tuple[Endpoint, ...] = ()
    for listed in lists:
        now = as_endpoints(listed)
        told.set_endpoints(now)
        changed.change_endpoints(now, changes(last, now))
        last = now
        assert seen(changed) == seen(told)


def test_a_change_the_router_missed_makes_it_take_the_whole_list():
    router = Router(config=RouterConfig())
    first = as_endpoints({"r0": (0, 0, 1, 0), "r1": (0, 0, 2, 0)})
    router.change_endpoints(first, changes((), first))
    second = as_endpoints({"r0": (0, 0, 1, 0), "r1": (0, 0, 2, 0), "r2": (1, 0, 1, 0), "r3": (1, 0, 2, 0)})
    # Told only of r3: r2's push never came. The counts disagree, so the whole list is taken.
    router.change_endpoints(second, {"r3": second[3]})
    assert {st.replica_id for st in router.balancer.states()} == {"r0", "r1", "r2", "r3"}
    assert router.balancer.ready_count("m1") == 2
