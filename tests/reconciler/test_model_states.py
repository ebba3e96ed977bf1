"""What the router is told about models without a ready replica (issue 15), one pass at a time."""
from llmgwctl.catalog import load_text
from llmgwctl.contracts import ModelCondition
from llmgwctl.placement import Unplaceable
from llmgwctl.reconciler.modelstates import can_change_by_itself

from .test_reconciler import HEADER, World, catalog, converge, model


class StateSink:
    def __init__(self):
        self.endpoints, self.states = [], []

    def set_endpoints(self, endpoints):
        self.endpoints.append(tuple(endpoints))

    def set_model_states(self, states):
        self.states.append(tuple(states))

    # The rest of the sink contract (contracts.RouterSink).
    def change_endpoints(self, endpoints, changed):
        self.endpoints.append(tuple(endpoints))

    def set_catalog(self, catalog):
        pass


def told(w):
    return {s.name: (s.state, s.retry) for s in w.rec.model_states}


def test_a_model_the_fleet_can_never_hold_is_unplaceable_without_retry():
    w = World(catalog(model("huge", gpus=8), model("nopool", pool="h100"), model("fits")), settle=0)
    sink = StateSink()
    w.rec.add_sink(sink)
    w.report("n1", gpus=4)
    w.quiet_pass()
    assert told(w) == {"huge": (ModelCondition.UNPLACEABLE, False), "nopool": (ModelCondition.UNPLACEABLE, False),
                       "fits": (ModelCondition.STARTING, True)}
    assert sink.states[-1] == w.rec.model_states
    assert "needs 8" in next(s.reason for s in w.rec.model_states if s.name == "huge")


def test_no_room_now_is_unplaceable_with_retry_and_a_ready_model_is_not_mentioned():
    w = World(catalog(model("first", gpus=2), model("second", gpus=2)), settle=0)
    w.report("n1", gpus=2)
    converge(w)
    assert told(w) == {"second": (ModelCondition.UNPLACEABLE, True)}


def test_a_node_joining_makes_the_model_starting_and_then_unmentioned():
    w = World(catalog(model("huge", gpus=8)), settle=0)
    w.report("n1", gpus=4)
    w.quiet_pass()
    assert told(w) == {"huge": (ModelCondition.UNPLACEABLE, False)}
    w.report("big", gpus=8)
    w.quiet_pass()
    assert told(w) == {"huge": (ModelCondition.STARTING, True)}
    w.alive.discard("n1")
    w.agent_follows("big")
    w.quiet_pass()
    assert told(w) == {}


def test_placements_permanent_marker_decides_retry():
    # A node in the pool lacks the engine: placement calls that permanent (only
    # installing it, a change to the fleet, helps), and the router is told not
    # to retry -- where judging from GPU counts alone would have said retry.
    w = World(load_text(HEADER + "  - name: cpp\n    profiles: [{name: p, engine: llamacpp, pool: gpu, gpus: 1}]\n"),
              settle=0)
    w.report("n1", gpus=4)
    w.quiet_pass()
    assert w.rec.unplaceable_detail["cpp"].permanent
    assert told(w) == {"cpp": (ModelCondition.UNPLACEABLE, False)}


def test_a_reason_without_placements_record_is_judged_conservatively_from_the_inventory():
    w = World(catalog(model("huge", gpus=8), model("fits", gpus=2)), settle=0)
    w.report("n1", gpus=4)
    cat, nodes = w.live.current, list(w.inventory.nodes())
    assert not can_change_by_itself(cat.resolve("huge"), "no room", nodes)     # no node has 8 GPUs
    assert can_change_by_itself(cat.resolve("fits"), "no room", nodes)
    assert can_change_by_itself(cat.resolve("huge"), "no room", [])            # no agent has reported yet
    assert can_change_by_itself(cat.resolve("huge"), Unplaceable("huge", "no room", permanent=False), nodes)
