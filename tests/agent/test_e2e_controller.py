"""End to end, controller mode: the agent long-polls the real control API for
its desired replicas and converges on every new answer; a failing controller
changes nothing on the node."""
from __future__ import annotations

from llmgwctl.contracts import ReplicaSpec

from ..support import wait_until
from .harness import group_alive, replicas_by_id

NODE = "cpu-1"


def spec(rid: str, model: str, *args: str) -> ReplicaSpec:
    return ReplicaSpec(id=rid, model=model, profile="cpu", engine="fake", source=model, gpus=0, args=args)


def latest_with(controller, predicate, what):
    return wait_until(lambda: (r := controller.latest()) and predicate(replicas_by_id(r)) and r, what)


def test_agent_follows_the_controller(tmp_path, agents, controller, port_range):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    agent = agents("--controller", controller.url, "--node", NODE, "--gpus", "none", "--ports", port_range,
                   "--token-file", str(token), "--grace", "10")

    # Nothing desired yet: the agent polls from version 0 and reports an empty node.
    wait_until(lambda: controller.polls, "a first long-poll")
    report = wait_until(controller.latest, "a first report")
    # Each poll says which agent process asks: the controller answers only the one speaking for the node.
    instance = report["instance_id"]
    assert instance and controller.polls[0] == {"after": "0", "instance": instance}
    assert report["replicas"] == [] and report["gpus"] == []
    assert controller.report_headers[0]["Authorization"] == "Bearer s3cret"

    # A first version: one replica.
    first = controller.set_desired(NODE, [spec("a", "m-a")])
    report = latest_with(controller, lambda reps: reps.get("a", {}).get("state") == "ready", "a ready")
    a = replicas_by_id(report)["a"]
    assert a["profile"] == "cpu" and a["gpu_indices"] == []
    wait_until(lambda: {"after": str(first), "instance": instance} in controller.polls, "a poll after the first version")

    # The next version: a second replica joins, the first is untouched.
    controller.set_desired(NODE, [spec("a", "m-a"), spec("b", "m-b")])
    report = latest_with(controller, lambda reps: reps.get("b", {}).get("state") == "ready", "b ready")
    assert replicas_by_id(report)["a"]["pid"] == a["pid"]

    # The next: a's spec changes (new args -> new spec hash): it is replaced.
    controller.set_desired(NODE, [spec("a", "m-a", "--default-max-tokens", "4"), spec("b", "m-b")])
    report = latest_with(controller, lambda reps: reps.get("a", {}).get("state") == "ready"
                         and reps["a"]["spec_hash"] != a["spec_hash"], "a replaced")
    new_a = replicas_by_id(report)["a"]
    assert new_a["pid"] != a["pid"] and group_alive(a["pid"]) == []
    b_pid = replicas_by_id(report)["b"]["pid"]

    # The controller fails: the last desired list holds, nothing is stopped.
    controller.fail_status = 503
    polls = len(controller.polls)
    wait_until(lambda: len(controller.polls) >= polls + 2, "the agent to retry against the failing controller")
    assert group_alive(new_a["pid"]) and group_alive(b_pid)
    controller.fail_status = None

    # The last: nothing desired: both stopped, nothing of their groups left.
    controller.set_desired(NODE, [])
    latest_with(controller, lambda reps: reps == {}, "both stopped")
    assert group_alive(new_a["pid"]) == [] and group_alive(b_pid) == []
    assert "keeping the last desired list" in agent.log()
