"""Router API keys: 401 / 403 / 429 against a real router and a real fake engine, and reloading the key file.

"Changed nothing" is checked where it would show: the engine served no
request, and the router recorded no use of the endpoint.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import requests

from llmgwctl.router.auth import KeyFileError, KeyFileWatcher, hash_key, load_keys
from tests.procs import kill_group
from tests.router.harness import _readline, catalog, make_router, static_router_args, wait_until

MODEL = "sec-qwen"
OTHER = "sec-llama"
KEY_A, KEY_B, KEY_C = "sk-team-a-" + "a" * 32, "sk-team-b-" + "b" * 32, "sk-team-c-" + "c" * 32


def keys_yaml(*entries: tuple[str, str, list[str], int]) -> str:
    lines = ["keys:"]
    for name, key, models, rpm in entries:
        lines.append(f"  - {{name: {name}, sha256: {hash_key(key)}, models: {models!r}, rpm: {rpm}}}")
    return "\n".join(lines) + "\n"


def served(engine) -> float:
    text = requests.get(engine.url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def chat(url: str, key: str | None, model: str = MODEL) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(url + "/v1/chat/completions", headers=headers, timeout=30,
                         json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.fixture
def keyed(tmp_path, engines, routers):
    engine = engines(MODEL, "sec-r1")
    rt = routers(make_router(catalog((MODEL, ("qwen",)), (OTHER, ()))))
    rt.set_endpoints([engine.endpoint()])
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(("team-a", KEY_A, ["qwen*", "sec-qwen"], 100), ("team-b", KEY_B, ["qwen"], 2)))
    watcher = KeyFileWatcher(path, rt.router.set_api_keys)
    rt.call(watcher.load_initial)
    return rt, engine, watcher, path


def test_a_valid_key_is_served(keyed):
    rt, engine, _, _ = keyed
    r = chat(rt.url, KEY_A)
    assert r.status_code == 200, r.text
    assert served(engine) == 1


@pytest.mark.parametrize("header", [None, "Bearer ", "Bearer sk-not-a-key", "Basic " + KEY_A, KEY_A])
def test_missing_or_unknown_key_is_401_and_changes_nothing(keyed, header):
    rt, engine, _, _ = keyed
    headers = {"Authorization": header} if header is not None else {}
    r = requests.post(rt.url + "/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
    assert served(engine) == 0
    assert rt.call(rt.router.usage_snapshot) == {"sec-r1": (None, 0)}
    assert requests.get(rt.url + "/v1/models", headers=headers, timeout=10).status_code == 401
    assert requests.get(rt.url + "/metrics", headers=headers, timeout=10).status_code == 401
    assert requests.get(rt.url + "/healthz", timeout=10).status_code == 200      # probes need no key


def test_a_model_the_key_may_not_use_is_403_whether_or_not_it_exists(keyed):
    rt, engine, _, _ = keyed
    exists = chat(rt.url, KEY_A, OTHER)
    missing = chat(rt.url, KEY_A, "sec-does-not-exist")
    assert exists.status_code == missing.status_code == 403
    # The same words but the name: nothing tells the two apart.
    assert exists.json()["error"]["message"].replace(OTHER, "X") == \
        missing.json()["error"]["message"].replace("sec-does-not-exist", "X")
    assert exists.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_permitted"
    assert served(engine) == 0
    assert rt.call(rt.router.usage_snapshot) == {"sec-r1": (None, 0)}
    # Only a name the key may use can get the router's 404.
    assert chat(rt.url, KEY_A, "qwen-nonexistent").status_code == 404


def test_an_alias_pattern_covers_the_model_behind_it(keyed):
    rt, engine, _, _ = keyed
    # team-b may use "qwen", an alias of sec-qwen: the canonical name is the same model.
    assert chat(rt.url, KEY_B, "qwen").status_code == 200
    assert chat(rt.url, KEY_B, MODEL).status_code == 200
    assert served(engine) == 2


def test_models_list_shows_only_what_the_key_may_use(keyed):
    rt, _, _, _ = keyed
    ids = {m["id"] for m in requests.get(rt.url + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"},
                                         timeout=10).json()["data"]}
    assert ids == {MODEL, "qwen"}
    # Retrieving one answers as OpenAI's retrieve: the same 404 outside the
    # key's patterns whether or not the model exists.
    key_a = {"Authorization": f"Bearer {KEY_A}"}
    assert requests.get(rt.url + "/v1/models/qwen", headers=key_a, timeout=10).json()["llmgw"]["alias_of"] == MODEL
    forbidden = [requests.get(rt.url + f"/v1/models/{name}", headers=key_a, timeout=10)
                 for name in (OTHER, "sec-does-not-exist")]
    assert [r.status_code for r in forbidden] == [404, 404]
    assert forbidden[0].json()["error"]["message"].replace(OTHER, "X") == \
        forbidden[1].json()["error"]["message"].replace("sec-does-not-exist", "X")
    assert requests.get(rt.url + "/v1/models/qwen-nonexistent", headers=key_a, timeout=10).status_code == 404
    assert requests.get(rt.url + "/v1/models/qwen", timeout=10).status_code == 401


def test_over_the_rate_is_429_with_retry_after_and_changes_nothing(keyed):
    rt, engine, _, _ = keyed
    assert chat(rt.url, KEY_B, "qwen").status_code == 200
    assert chat(rt.url, KEY_B, "qwen").status_code == 200
    assert served(engine) == 2
    last_use = rt.call(rt.router.usage_snapshot)["sec-r1"]
    r = chat(rt.url, KEY_B, "qwen")
    assert r.status_code == 429, r.text
    # rpm 2 refills one request every 30 s; the bucket was emptied a moment ago.
    assert 1 <= int(r.headers["Retry-After"]) <= 30
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert served(engine) == 2 and rt.call(rt.router.usage_snapshot)["sec-r1"] == last_use
    # Another key has its own bucket.
    assert chat(rt.url, KEY_A).status_code == 200


def test_reload_applies_a_valid_edit_and_keeps_the_old_keys_on_an_invalid_one(keyed):
    rt, _, watcher, path = keyed
    assert chat(rt.url, KEY_C).status_code == 401
    path.write_text(keys_yaml(("team-a", KEY_A, ["*"], 100), ("team-c", KEY_C, ["*"], 100)))
    assert rt.call(watcher.reload) is True
    assert chat(rt.url, KEY_C).status_code == 200
    assert chat(rt.url, KEY_B, "qwen").status_code == 401          # removed from the file: gone
    path.write_text("keys:\n  - {name: team-d, key: sk-plaintext, models: ['*'], rpm: 5}\n")
    assert rt.call(watcher.reload) is False
    assert "store the key's SHA-256" in watcher.last_error
    assert chat(rt.url, KEY_C).status_code == 200                   # the keys in force stayed
    # team-a's new '*' is in force too: past the key check, to "no replica" (sec-llama has none).
    assert chat(rt.url, KEY_A, OTHER).status_code == 503


@pytest.mark.parametrize("text, message", [
    ("keys: {}", "expected a mapping with a 'keys' list"),
    ("keys:\n  - {name: a, sha256: abc, models: ['*'], rpm: 5}", "keys[0].sha256: must be 64 hex digits"),
    ("keys:\n  - {name: a, sha256: " + "1" * 64 + ", models: ['*'], rpm: 5}", "quote it so YAML reads it as text"),
    ("keys:\n  - {name: a, sha256: " + "a" * 64 + ", models: '*', rpm: 5}", "keys[0].models: must be a list"),
    ("keys:\n  - {name: a, sha256: " + "a" * 64 + ", models: ['*'], rpm: 0}", "keys[0].rpm: must be a whole number"),
    ("keys:\n  - {name: a, sha256: " + "a" * 64 + ", models: ['*']}", "keys[0].rpm: required"),
    ("keys:\n  - {name: a, sha256: " + "a" * 64 + ", models: ['*'], rpm: 1}\n"
     "  - {name: a, sha256: " + "b" * 64 + ", models: ['*'], rpm: 1}", "keys[1].name: 'a' is already used by keys[0]"),
    ("keys: [\n", "not valid YAML"),
])
def test_invalid_key_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=re.escape(message)):
        load_keys(path)


def test_standalone_router_follows_edits_of_the_key_file(tmp_path, engines):
    """The real watcher in a real `llmgwctl router --api-keys`: an editor's save is in force without a restart."""
    engine = engines(MODEL, "sec-follow")
    served = static_router_args(tmp_path, MODEL, engine.url, "sec-follow")
    keys = tmp_path / "keys.yaml"
    keys.write_text(keys_yaml(("team-a", KEY_A, ["*"], 100)))
    proc = subprocess.Popen([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0", *served,
                             "--api-keys", str(keys), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        url = _readline(proc, 20).rsplit(" ", 1)[-1].strip()
        assert chat(url, KEY_A).status_code == 200 and chat(url, KEY_C).status_code == 401
        tmp = tmp_path / ".keys.yaml.swp"
        tmp.write_text(keys_yaml(("team-c", KEY_C, ["*"], 100)))
        os.replace(tmp, keys)
        wait_until(lambda: chat(url, KEY_C).status_code == 200, timeout=15, what="the new key to be in force")
        assert chat(url, KEY_A).status_code == 401
        keys.write_text("keys: [{name: broken}]\n")
        # Nothing to wait for but the reload itself: poll the reload counter.
        wait_until(lambda: 'llmgw_router_api_keys_reloads_total{result="rejected"}' in
                   requests.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY_C}"}, timeout=10).text,
                   timeout=15, what="the invalid edit to be rejected")
        assert chat(url, KEY_C).status_code == 200
    finally:
        kill_group(proc)


def test_a_router_with_an_invalid_key_file_does_not_start(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "m.yaml").write_text(
        f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: {MODEL}\n    source: org/m\n"
        "    profiles: [{name: default, engine: fake, gpus: 0}]\n")
    (tmp_path / "eps.yaml").write_text(f"endpoints:\n  - {{model: {MODEL}, url: 'http://127.0.0.1:9', id: x}}\n")
    (tmp_path / "keys.yaml").write_text("keys: [{name: a}]\n")
    result = subprocess.run([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0",
                             "--endpoints", str(tmp_path / "eps.yaml"), "--catalogs", str(tmp_path / "cat"),
                             "--api-keys", str(tmp_path / "keys.yaml")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "listening" not in result.stdout
    assert "keys[0].sha256: required" in result.stderr


def test_serve_loads_the_keys_before_its_router_answers(tmp_path):
    from tests.e2e.fleet import Fleet

    fleet = Fleet(tmp_path / "fleet")
    (fleet.catalogs / "m.yaml").write_text(
        f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: {MODEL}\n    aliases: [qwen]\n    source: org/m\n"
        "    profiles: [{name: default, engine: fake, gpus: 0}]\n")
    keys = tmp_path / "keys.yaml"
    keys.write_text(keys_yaml(("team-b", KEY_B, ["qwen"], 100)))
    try:
        fleet.start_controller("--api-keys", str(keys))
        wait_until(lambda: _status(fleet.router + "/healthz") == 200, timeout=30, what="the router")
        assert _status(fleet.router + "/v1/models") == 401
        listed = requests.get(fleet.router + "/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=10)
        assert {m["id"] for m in listed.json()["data"]} == {MODEL, "qwen"}
        assert chat(fleet.router, None).status_code == 401
        assert chat(fleet.router, KEY_B, "other").status_code == 403
    finally:
        fleet.close()


def _status(url: str) -> int:
    try:
        return requests.get(url, timeout=5).status_code
    except requests.RequestException:
        return 0
