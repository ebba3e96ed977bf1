"""LoRA adapters through `serve` on fake engines: placed on their base's replicas, loaded by the agent, routed to holders.

The fake engine speaks vLLM's adapter routes and answers each adapter under
its own name, so which replica answered (X-Fake-Replica) and as what (the
reply's model) are both visible. Every wait is bounded (wait_until).
"""
import os
import signal
import subprocess
import sys
import threading

import pytest
import requests
import yaml

from .fleet import Fleet, hold_streams, wait_until


def catalog(adapters: list[dict], replicas: int = 2, args: tuple[str, ...] = ()) -> str:
    return yaml.safe_dump({"apiVersion": "llmgw/v1", "kind": "Catalog", "models": [{
        "name": "base", "replicas": replicas,
        # lora: written, so the first adapter loads without a restart too.
        "lora": {"max_loras": 4},
        "profiles": [{"name": "cpu", "engine": "fake", "gpus": 0, **({"args": list(args)} if args else {})}],
        **({"adapters": adapters} if adapters else {}),
    }]})


def holders(fleet: Fleet, adapter: str) -> dict[str, str]:
    """replica id -> its state of `adapter`, for the replicas it is placed on."""
    return {r["id"]: a["state"] for r in fleet.replicas("base") for a in r.get("adapters") or [] if a["name"] == adapter}


def loaded_on(fleet: Fleet, adapter: str) -> list[str]:
    return sorted(rid for rid, state in holders(fleet, adapter).items() if state == "loaded")


def pids(fleet: Fleet) -> dict[str, int]:
    return {r["id"]: r["pid"] for r in fleet.replicas("base")}


def answered_by(reply: requests.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.headers["x-llmgw-replica"]


def test_adapters_are_loaded_by_edits_routed_to_holders_and_unloaded_without_restarting_the_base(tmp_path):
    sql_dir, chat_dir = tmp_path / "sql", tmp_path / "chat"
    sql_dir.mkdir()
    chat_dir.mkdir()
    fleet = Fleet(tmp_path)
    models = fleet.catalogs / "models.yaml"
    models.write_text(catalog([{"name": "sql", "aliases": ["sql-lora"], "source": str(sql_dir), "replicas": 1}]))
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: len(fleet.ready("base")) == 2, "two base replicas ready")
        wait_until(lambda: len(loaded_on(fleet, "sql")) == 1, "sql loaded on one replica")
        (holder,) = loaded_on(fleet, "sql")
        wait_until(lambda: fleet.chat("sql").status_code == 200, "the router routing sql")
        before = pids(fleet)

        # With two base replicas and the adapter on one, every adapter request goes to that one.
        answers = [fleet.chat("sql", content=f"question {i}") for i in range(20)]
        assert {answered_by(a) for a in answers} == {holder}
        # The engine got the adapter's name (an alias is renamed), and answers as it: not as the base.
        # The client hears back the alias it asked by (issue 29's echo).
        by_alias = fleet.chat("sql-lora", content="same prompt")
        by_name = fleet.chat("sql", content="same prompt")
        base = fleet.chat("base", content="same prompt")
        assert by_alias.json()["model"] == "sql-lora" and base.json()["model"] == "base"
        text = by_alias.json()["choices"][0]["message"]["content"]
        assert text == by_name.json()["choices"][0]["message"]["content"]
        assert text != base.json()["choices"][0]["message"]["content"]

        # /v1/models lists it with its parent; the engine's load route is not the client's.
        listed = {m["id"]: m for m in requests.get(fleet.router + "/v1/models", timeout=10).json()["data"]}
        assert listed["sql"]["parent"] == "base" and listed["sql"]["llmgw"]["ready_replicas"] == 1
        assert listed["sql-lora"]["parent"] == "base"
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            refused = requests.post(fleet.router + route, json={"lora_name": "x", "lora_path": str(sql_dir)}, timeout=10)
            assert refused.status_code == 404, refused.text

        # An edit adds a second adapter on every replica: loaded, no engine restarted.
        models.write_text(catalog([{"name": "sql", "aliases": ["sql-lora"], "source": str(sql_dir), "replicas": 1},
                                   {"name": "chat", "source": str(chat_dir)}]))
        wait_until(lambda: len(loaded_on(fleet, "chat")) == 2, "chat loaded on both replicas")
        wait_until(lambda: fleet.chat("chat").status_code == 200, "the router routing chat")
        assert pids(fleet) == before
        assert len({answered_by(fleet.chat("chat", content=f"q{i}")) for i in range(20)}) == 2

        # Removing one: its name is unknown at once, the agents unload it, the base and the other go on.
        models.write_text(catalog([{"name": "chat", "source": str(chat_dir)}]))
        wait_until(lambda: fleet.chat("sql").status_code == 404, "sql gone from the router")
        wait_until(lambda: not holders(fleet, "sql"), "sql unloaded from the engines")
        engine = next(r["url"] for r in fleet.replicas("base") if r["id"] == holder)
        served = [m["id"] for m in requests.get(engine + "/v1/models", timeout=10).json()["data"]]
        assert "sql" not in served and "chat" in served
        assert fleet.chat("base").status_code == 200 and fleet.chat("chat").status_code == 200
        assert pids(fleet) == before

        # An engine that restarts gets its adapters back.
        os.kill(before[holder], signal.SIGKILL)
        wait_until(lambda: pids(fleet).get(holder) not in (None, before[holder]) and
                   holders(fleet, "chat").get(holder) == "loaded", "the restarted engine with chat loaded again")
        engine = next(r["url"] for r in fleet.replicas("base") if r["id"] == holder)
        assert "chat" in [m["id"] for m in requests.get(engine + "/v1/models", timeout=10).json()["data"]]
    finally:
        fleet.close()


def test_an_adapter_that_cannot_load_is_retried_and_says_why_and_its_requests_get_503(tmp_path):
    fleet = Fleet(tmp_path)
    missing = tmp_path / "no-such-adapter"
    (fleet.catalogs / "models.yaml").write_text(catalog([{"name": "broken", "source": str(missing)}], replicas=1))
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: len(fleet.ready("base")) == 1, "the base replica ready")
        wait_until(lambda: holders(fleet, "broken") == {fleet.ready("base")[0]["id"]: "failed"}, "the load failed")
        (row,) = fleet.replicas("base")
        (status,) = row["adapters"]
        assert "no such directory" in status["reason"] and str(missing) in status["reason"]
        reply = fleet.chat("broken")
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "adapter_not_loaded"
        assert "Retry-After" in reply.headers
        assert fleet.chat("base").status_code == 200
        # The directory appears: the next retry (back-off from 2 s) loads it.
        missing.mkdir()
        wait_until(lambda: holders(fleet, "broken") == {row["id"]: "loaded"}, "the retried load", timeout=60)
        wait_until(lambda: fleet.chat("broken").status_code == 200, "the router routing it")
    finally:
        fleet.close()


def test_a_load_the_engine_refuses_shows_its_words_in_status_and_loads_once_there_is_room(tmp_path):
    # The engine holds one adapter (the fake's --max-adapters): the second's load reaches it and is refused.
    fleet = Fleet(tmp_path)
    models = fleet.catalogs / "models.yaml"
    first, second = {"name": "first", "source": "org/first"}, {"name": "second", "source": "org/second"}
    models.write_text(catalog([first, second], replicas=1, args=("--max-adapters", "1")))
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: len(fleet.ready("base")) == 1, "the base replica ready")
        rid = fleet.ready("base")[0]["id"]
        wait_until(lambda: holders(fleet, "second") == {rid: "failed"}, "second's load refused")
        assert holders(fleet, "first") == {rid: "loaded"}
        reason = next(a["reason"] for a in fleet.replicas("base")[0]["adapters"] if a["name"] == "second")
        assert reason.startswith("engine answered 400: ") and "holds at most 1 adapters" in reason, reason
        # `llmgwctl status` says it on the replica's adapters line and with the engine's words.
        out = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", fleet.control],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())     # its long lines are wrapped
        assert f"{rid} adapters: first, second (failed)" in text, out.stdout
        assert f"{rid} adapter second failed: engine answered 400: Loading lora second failed" in text, out.stdout
        reply = fleet.chat("second")
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "adapter_not_loaded"
        assert "second" in reply.json()["error"]["message"]
        assert fleet.chat("first").status_code == 200
        # first leaves the catalog: unloaded, and second's next retry finds the room.
        models.write_text(catalog([second], replicas=1, args=("--max-adapters", "1")))
        wait_until(lambda: holders(fleet, "second") == {rid: "loaded"}, "second loaded on a retry", timeout=60)
        wait_until(lambda: fleet.chat("second").status_code == 200, "the router routing second")
        assert "adapter second did not load (retrying in" in fleet.log("serve")
    finally:
        fleet.close()


def test_a_restarted_serve_adopts_the_engine_with_its_adapters_loaded(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(catalog([{"name": "sql", "source": "org/sql-lora"}], replicas=1))
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: len(loaded_on(fleet, "sql")) == 1, "sql loaded")
        before = pids(fleet)
        fleet.kill_controller()
        fleet.start_serve("--settle", "1")
        wait_until(lambda: loaded_on(fleet, "sql") == list(before), "the adopted engine's adapter known again")
        wait_until(lambda: fleet.chat("sql").status_code == 200, "sql routed again")
        assert pids(fleet) == before
        # Learnt from the engine's /v1/models, not loaded a second time.
        assert "adapter sql loaded" not in fleet.log("serve").split("adopted pid")[-1]
    finally:
        fleet.close()


def test_a_standalone_router_routes_adapters_from_the_watch_stream(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(catalog([{"name": "sql", "source": "org/sql-lora", "replicas": 1}]))
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: len(loaded_on(fleet, "sql")) == 1, "sql loaded")
        (holder,) = loaded_on(fleet, "sql")
        router = fleet.start_router()

        def ask() -> requests.Response:
            return requests.post(router + "/v1/chat/completions", timeout=30,
                                 json={"model": "sql", "messages": [{"role": "user", "content": "hi"}]})
        wait_until(lambda: ask().status_code == 200, "the standalone router routing sql")
        assert {answered_by(ask()) for _ in range(10)} == {holder}
    finally:
        fleet.close()


SPREAD = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: base
    replicas: 4
    lora: {max_loras: 4}
    profiles:
      - {name: cpu, engine: fake, gpus: 0, args: ["--tokens-per-second", "20"]}
    adapters:
      - name: hot
        source: org/hot-lora
        replicas: {min: 1, max: 3}
        autoscale: {target: 2, scale_down_window: 3s}
"""
def spread_of(fleet: Fleet, adapter: str) -> dict:
    model = next(m for m in fleet.status()["models"] if m["name"] == "base")
    return next(a for a in model["adapters"] if a["name"] == adapter)


@pytest.mark.parametrize("through", ["serve", "standalone"])
def test_an_adapter_spreads_to_more_replicas_under_its_own_load_and_back_after_the_window(tmp_path, through):
    # Through `serve`'s own router, or a standalone router whose usage reports carry the adapter's counter.
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "models.yaml").write_text(SPREAD)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    seen: set[str] = set()
    try:
        fleet.start_serve("--settle", "1")
        wait_until(lambda: len(fleet.ready("base")) == 4, "four base replicas ready")
        wait_until(lambda: len(loaded_on(fleet, "hot")) == 1, "hot loaded on one replica")
        (first,) = loaded_on(fleet, "hot")
        router = fleet.router if through == "serve" else fleet.start_router()
        wait_until(lambda: requests.post(router + "/v1/chat/completions", timeout=30, json={
            "model": "hot", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200,
            "the router routing hot")
        before = pids(fleet)

        # Six streams held open at 2 per holder: 3 holders, its max.
        threads = hold_streams(router, stop, "hot", seen)
        wait_until(lambda: len(loaded_on(fleet, "hot")) == 3, "hot loaded on three replicas under load", timeout=90)
        spread = spread_of(fleet, "hot")
        assert (spread["holders"], spread["of"], spread["max"]) == (3, 4, 3), spread
        assert spread["reason"].startswith("spread to 3 of 4 replicas: ") and "against a target of 2" in spread["reason"]
        # Its requests reach the new holders, not only the first.
        wait_until(lambda: len(seen) == 3, "hot's requests answered by its three holders", timeout=60)
        assert seen == set(loaded_on(fleet, "hot")) and first in seen
        events = [e["message"] for e in fleet.status()["events"] if e["kind"] == "adapter-spread"]
        assert events and "adapter hot of base: spread to" in events[0], events
        # Visible in metrics too.
        metrics = requests.get(fleet.control + "/metrics", timeout=10).text
        assert 'llmgw_adapter_spread{model="base",adapter="hot"} 3' in metrics

        stop.set()
        for t in threads:
            t.join(timeout=30)
        wait_until(lambda: len(loaded_on(fleet, "hot")) == 1 and len(holders(fleet, "hot")) == 1,
                   "hot back on one replica after the window", timeout=90)
        assert spread_of(fleet, "hot")["holders"] == 1
        assert any("back to 1 replica" in e["message"] for e in fleet.status()["events"]
                   if e["kind"] == "adapter-spread")
        assert fleet.chat("hot").status_code == 200, "the holder left serves it"
        assert pids(fleet) == before, "a spread loads and unloads: no engine restarted"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        fleet.close()
