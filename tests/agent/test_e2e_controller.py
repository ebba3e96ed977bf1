"""End to end, controller mode: the agent long-polls a recording controller for
its desired replicas and converges on every new answer; a failing controller
changes nothing on the node."""
from __future__ import annotations

from .harness import group_alive, replicas_by_id, wait_for


def spec(rid: str, model: str, *args: str) -> dict:
    return {"id": rid, "model": model, "profile": "cpu", "engine": "fake", "source": model, "gpus": 0,
            "args": list(args)}


def latest_with(controller, predicate, what):
    return wait_for(what, lambda: (r := controller.latest()) and predicate(replicas_by_id(r)) and r)


def test_agent_follows_the_controller(tmp_path, agents, controller, port_range):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    agent = agents("--controller", controller.url, "--node", "cpu-1", "--gpus", "none", "--ports", port_range,
                   "--token-file", str(token), "--grace", "10")

    # Nothing desired yet: the agent polls from version 0 and reports an empty node.
    wait_for("a first long-poll", lambda: controller.polls)
    report = wait_for("a first report", controller.latest)
    # Each poll says which agent process asks: the controller answers only the one speaking for the node.
    assert controller.polls[0] == {"after": "0", "instance": report["instance_id"]}
    assert report["replicas"] == [] and report["gpus"] == []
    assert controller.report_headers[0]["Authorization"] == "Bearer s3cret"

    # Version 1: one replica.
    controller.set_desired([spec("a", "m-a")])
    report = latest_with(controller, lambda reps: reps.get("a", {}).get("state") == "ready", "a ready")
    a = replicas_by_id(report)["a"]
    assert a["profile"] == "cpu" and a["gpu_indices"] == []
    wait_for("a poll after version 1", lambda: any(p["after"] == "1" for p in controller.polls))

    # Version 2: a second replica joins, the first is untouched.
    controller.set_desired([spec("a", "m-a"), spec("b", "m-b")])
    report = latest_with(controller, lambda reps: reps.get("b", {}).get("state") == "ready", "b ready")
    assert replicas_by_id(report)["a"]["pid"] == a["pid"]

    # Version 3: a's spec changes (new args -> new spec hash): it is replaced.
    controller.set_desired([spec("a", "m-a", "--default-max-tokens", "4"), spec("b", "m-b")])
    report = latest_with(controller, lambda reps: reps.get("a", {}).get("state") == "ready"
                         and reps["a"]["spec_hash"] != a["spec_hash"], "a replaced")
    new_a = replicas_by_id(report)["a"]
    assert new_a["pid"] != a["pid"] and group_alive(a["pid"]) == []
    b_pid = replicas_by_id(report)["b"]["pid"]

    # The controller fails: the last desired list holds, nothing is stopped.
    controller.fail_status = 503
    polls = len(controller.polls)
    wait_for("the agent to retry against the failing controller", lambda: len(controller.polls) >= polls + 2)
    assert group_alive(new_a["pid"]) and group_alive(b_pid)
    controller.fail_status = None

    # Version 4: nothing desired: both stopped, nothing of their groups left.
    controller.set_desired([])
    latest_with(controller, lambda reps: reps == {}, "both stopped")
    assert group_alive(new_a["pid"]) == [] and group_alive(b_pid) == []
    assert "keeping the last desired list" in agent.log()
