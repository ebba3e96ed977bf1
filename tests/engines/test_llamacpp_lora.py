"""LoRA adapters on llama.cpp: loaded at launch (--lora, in order, scale 0), numbered from the engine's listing,
and part of the replica's spec hash (an adapter edit is a new replica)."""
from __future__ import annotations

import pytest

from llmgwctl.catalog import load_text
from llmgwctl.contracts import AdapterSpec, AdapterStatus, ReplicaSpec
from llmgwctl.engines import LaunchError
from llmgwctl.engines.lora import numbered

from .test_drivers import gguf, launch, llama_server, spec  # noqa: F401 -- fixtures

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: base
    profiles: [{{engine: llamacpp, gpus: 0}}, {{engine: fake, gpus: 0}}]
    adapters: [{adapters}]
"""


def with_adapters(s: ReplicaSpec, *adapters: AdapterSpec) -> ReplicaSpec:
    return ReplicaSpec(**{**{f: getattr(s, f) for f in ("id", "model", "profile", "engine", "source", "gpus",
                                                       "args", "env", "gpu_indices")}, "adapters": adapters})


def test_each_adapter_is_one_lora_flag_in_order_loaded_at_scale_zero(gguf, llama_server, tmp_path):  # noqa: F811
    sql, chat = tmp_path / "sql.gguf", tmp_path / "a,b.gguf"
    sql.write_bytes(b"GGUF")
    chat.write_bytes(b"GGUF")
    s = with_adapters(spec("llamacpp", gpus=0, gpu_indices=(), source=str(gguf), args=["-c", "2048"]),
                      AdapterSpec("sql", str(sql)), AdapterSpec("chat", str(chat)))
    got = launch(s)
    # In the spec's order, which is the engine's numbering; a comma in a path is
    # quoted, since llama-server splits each --lora at commas; the profile's args last.
    assert got.argv == (llama_server, "-m", str(gguf), "--lora", str(sql), "--lora", f'"{chat}"',
                        "--lora-init-without-apply", "--host", "127.0.0.1", "--port", "41001",
                        "--alias", "qwen2.5-7b-instruct", "--metrics", "-c", "2048")


def test_an_adapter_file_missing_on_the_node_names_the_adapter_before_any_process_starts(gguf, llama_server):  # noqa: F811
    s = with_adapters(spec("llamacpp", gpus=0, gpu_indices=(), source=str(gguf)), AdapterSpec("sql", "/no/sql.gguf"))
    with pytest.raises(LaunchError, match=r"adapter 'sql': source '/no/sql.gguf': no such file on this node"):
        launch(s)


def test_a_llamacpp_replica_holds_every_adapter_in_its_hash_and_a_fake_one_does_not():
    def specs(adapters: str) -> tuple[ReplicaSpec, ReplicaSpec]:
        catalog = load_text(CATALOG.format(adapters=adapters))
        (model,) = catalog.models
        return tuple(ReplicaSpec.for_profile("r", model, p, catalog.engines[p.engine]) for p in model.profiles)

    one_llama, one_fake = specs("{name: a, source: /a.gguf}")
    two_llama, two_fake = specs("{name: a, source: /a.gguf}, {name: b, source: /b.gguf}")
    moved_llama, _ = specs("{name: a, source: /other/a.gguf}")
    # llama.cpp: the model's adapters, in order, no vLLM slots; an adapter edit is another process.
    assert two_llama.adapters == (AdapterSpec("a", "/a.gguf"), AdapterSpec("b", "/b.gguf"))
    assert two_llama.lora_slots == 0
    assert len({one_llama.spec_hash, two_llama.spec_hash, moved_llama.spec_hash}) == 3
    # The fake (vLLM's runtime API): adapters are placed later, outside the hash.
    assert one_fake.adapters == () and one_fake.spec_hash == two_fake.spec_hash and one_fake.lora_slots == 4
    # The wire form keeps what the hash is made of.
    assert ReplicaSpec.from_dict(two_llama.to_dict()).spec_hash == two_llama.spec_hash


def test_the_engine_listing_says_which_number_is_which_adapter():
    paths = [("sql", "/a/sql.gguf"), ("chat", "/a/chat.gguf"), ("chat-too", "/a/chat.gguf"), ("gone", "/a/gone.gguf")]
    listing = [{"id": 1, "path": "/a/chat.gguf", "scale": 0.0}, {"id": 0, "path": "/a/sql.gguf", "scale": 0.0},
               {"id": 2, "path": "/a/chat.gguf"}, {"id": "3", "path": "/a/gone.gguf"}, "junk",
               {"id": 4, "path": "/a/unknown.gguf"}]
    # By path, never by guessing from launch order; one file under two names gets a number each;
    # an entry without an integer id, and an adapter the engine does not list, match nothing.
    assert numbered(listing, paths) == {"chat": 1, "sql": 0, "chat-too": 2}
    with pytest.raises(ValueError, match="expected a list"):
        numbered({"id": 0}, paths)


def test_an_adapter_status_carries_the_engine_number_over_the_wire():
    status = AdapterStatus("sql", "loaded", engine_id=3)
    assert AdapterStatus.from_dict(status.to_dict()) == status
    assert "engine_id" not in AdapterStatus("sql", "loaded").to_dict()
    for bad in (-1, "3", True, 10**6):
        with pytest.raises(ValueError, match="engine_id"):
            AdapterStatus.from_dict({"name": "sql", "state": "loaded", "engine_id": bad})
