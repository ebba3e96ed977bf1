"""LoRA adapters on real llama.cpp behind `llmgwctl serve`: GGUF adapters for the bundled SmolLM2, loaded at launch.

The adapters are made in the test (llamacpp_lora.py: seeded random LoRA
factors written with the `gguf` package, cached beside the model), and the
bundled smollm2 is served with the first. The tests check, through the
router: the base and the adapter answer the same prompt differently at
temperature 0, the adapter's answer naming the adapter, and status saying
which number the engine gave it; a key limited to the base cannot reach the
adapter by a `lora` member it writes itself (it gets the base's answer) nor
by name; and adding a second adapter by a catalog edit replaces the replica,
surge first -- `catalog apply` and status say why, the base answers
throughout, and the replacement serves both adapters under their numbers.

Skipped when llama-server, the model or the gguf package is missing, unless
LLMGW_REQUIRE_LLAMACPP=1 (.ci/run sets it).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests
import yaml

from llmgwctl.catalog.modelrules import LAUNCH_LORA_REASON
from llmgwctl.engines import LaunchError, driver_for
from llmgwctl.engines.llamacpp import resolve_gguf
from llmgwctl.router.auth import hash_key

from .fleet import Fleet, wait_until
from .llamacpp_lora import gguf_lora_adapter, need
from .test_real_model import MODEL, REPO, bundled_source, status_cli
from .vllm import reporter

pytestmark = pytest.mark.timeout(900)
READY_TIMEOUT = 240.0
REQUEST_TIMEOUT = 120.0
PROMPT = [{"role": "user", "content": "Name three colours."}]
KEY_ALL, KEY_BASE = "sk-every-model", "sk-base-only"


def lora_catalog(adapters: list[dict]) -> str:
    """The bundled smollm2 on llama.cpp (its source and args as shipped), with `adapters`."""
    doc = yaml.safe_load((REPO / "catalogs" / "models.yaml").read_text())
    doc["models"] = [m for m in doc["models"] if m["name"] == MODEL]
    doc["models"][0]["adapters"] = adapters
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def made():
    ok, reason = driver_for("llamacpp").available()
    need(ok, reason)
    try:
        base = resolve_gguf(bundled_source())
    except LaunchError as exc:
        need(False, str(exc))
    return {"first": gguf_lora_adapter(base, "first", seed=1), "second": gguf_lora_adapter(base, "second", seed=2)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, request, made):
    root = tmp_path_factory.mktemp("llamacpp-lora")
    fleet = Fleet(root)
    fleet.say = reporter(request)    # type: ignore[attr-defined]
    (fleet.catalogs / "models.yaml").write_text(lora_catalog([{"name": "smollm2-first", "source": str(made["first"])}]))
    keys = root / "keys.yaml"
    keys.write_text("keys:\n"
                    f"  - {{name: every, sha256: {hash_key(KEY_ALL)}, models: ['*'], rpm: 10000}}\n"
                    f"  - {{name: base-only, sha256: {hash_key(KEY_BASE)}, models: [{MODEL}], rpm: 10000}}\n")
    try:
        fleet.start_serve("--settle", "2", "--api-keys", str(keys))

        def held() -> bool:
            failed = fleet.replicas(MODEL, "failed")
            if failed:
                pytest.fail(f"smollm2 failed to start: {failed[0]['reason']}\n{fleet.log('serve')[-3000:]}")
            return loaded(fleet) == {"smollm2-first": 0}
        wait_until(held, "smollm2 ready with its adapter numbered", timeout=READY_TIMEOUT, every=0.25)
        yield fleet
    finally:
        fleet.close_checked()


def ask(fleet: Fleet, model: str, key: str = KEY_ALL, **extra: object) -> requests.Response:
    return requests.post(fleet.router + "/v1/chat/completions", timeout=REQUEST_TIMEOUT,
                         headers={"Authorization": f"Bearer {key}"}, stream=bool(extra.get("stream")),
                         json={"model": model, "messages": PROMPT, "temperature": 0, "max_tokens": 16, **extra})


def said(resp: requests.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def loaded(fleet: Fleet) -> dict[str, int | None]:
    """Adapter -> the engine's number for it, over the ready replicas' loaded adapters."""
    return {a["name"]: a.get("engine_id") for r in fleet.ready(MODEL) for a in r["adapters"] if a["state"] == "loaded"}


def test_base_and_adapter_answer_the_same_prompt_differently(fleet):
    wait_until(lambda: ask(fleet, "smollm2-first").status_code == 200, "the router routing the adapter")
    base, tuned = ask(fleet, MODEL), ask(fleet, "smollm2-first")
    assert tuned.json()["model"] == "smollm2-first" and base.json()["model"] == MODEL
    fleet.say(f"llama.cpp lora: base said {said(base)!r}; the adapter said {said(tuned)!r}")
    assert said(base) != said(tuned)
    # Greedy: the same again, each.
    assert said(ask(fleet, MODEL)) == said(base) and said(ask(fleet, "smollm2-first")) == said(tuned)
    (replica,) = fleet.ready(MODEL)
    assert "--lora" in replica_argv(replica["pid"])
    shown = status_cli(fleet)
    assert f"{replica['id']} adapters: smollm2-first (id 0)" in shown.stdout, shown.stdout + shown.stderr
    # Streamed: the same text, each chunk naming the adapter (the engine's name the base's).
    with ask(fleet, "smollm2-first", stream=True) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"smollm2-first"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == said(tuned)


def test_a_base_only_key_cannot_reach_the_adapter_by_its_own_lora_member(fleet):
    base, tuned = said(ask(fleet, MODEL)), said(ask(fleet, "smollm2-first"))
    for crafted in ([{"id": 0, "scale": 1}], [{"id": 0, "scale": 1}, {"id": 0, "scale": 1}], []):
        got = ask(fleet, MODEL, KEY_BASE, lora=crafted)
        assert said(got) == base != tuned, crafted
    # The key on its own model, no member: still the base (llama-server would apply its launch scale).
    assert said(ask(fleet, MODEL, KEY_BASE)) == base
    refused = ask(fleet, "smollm2-first", KEY_BASE)
    assert refused.status_code == 403, refused.text
    # A key that may use the adapter gets it, whatever number it writes.
    assert said(ask(fleet, "smollm2-first", KEY_ALL, lora=[{"id": 7, "scale": 0}])) == tuned


def test_adding_an_adapter_replaces_the_replica_surge_first_and_says_why(fleet, made, tmp_path):
    (before,) = fleet.ready(MODEL)
    base = said(ask(fleet, MODEL))
    edited = tmp_path / "models.yaml"
    edited.write_text(lora_catalog([{"name": "smollm2-first", "source": str(made["first"])},
                                    {"name": "smollm2-second", "source": str(made["second"])}]))
    preview = apply(fleet, edited, "--dry-run")
    line = next((ln for ln in preview.splitlines() if f"replace {before['id']} ({MODEL}/cpu on " in ln), "")
    assert line.endswith(f": {LAUNCH_LORA_REASON}"), preview
    apply(fleet, edited)

    seen: dict[str, str] = {}
    codes: list[int] = []

    def replaced() -> bool:
        codes.append(ask(fleet, MODEL, max_tokens=1).status_code)     # the base answers throughout
        for r in fleet.replicas(MODEL):
            for a in r["adapters"]:
                if a.get("reason"):
                    seen[a["name"]] = a["reason"]
        ready = fleet.ready(MODEL)
        return len(ready) == 1 and ready[0]["id"] != before["id"] and len(loaded(fleet)) == 2
    wait_until(replaced, "a replacement holding both adapters", timeout=READY_TIMEOUT, every=0.1)
    assert set(codes) == {200}, codes
    # The old replica, while it served on beside its replacement, said why it was going.
    assert seen.get("smollm2-second") == LAUNCH_LORA_REASON, seen
    (after,) = fleet.ready(MODEL)
    assert after["pid"] != before["pid"]
    assert loaded(fleet) == {"smollm2-first": 0, "smollm2-second": 1}
    first, second = said(ask(fleet, "smollm2-first")), said(ask(fleet, "smollm2-second"))
    fleet.say(f"llama.cpp lora: the second adapter said {second!r}")
    assert said(ask(fleet, MODEL)) == base and len({base, first, second}) == 3


def apply(fleet: Fleet, path, *extra: str) -> str:
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "catalog", "apply", "-f", str(path),
                          "--controller", fleet.control, *extra], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def replica_argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")
