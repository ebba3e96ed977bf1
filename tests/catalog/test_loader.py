import json
import os

import pytest

from llmgwctl.catalog import CatalogError, load_dir, load_paths, load_text
from llmgwctl.catalog.loader import catalog_files

from .conftest import HEADER, catalog_yaml


def test_directory_is_the_union_of_its_files(tmp_path, write):
    write("a.yaml", catalog_yaml("a:x"))
    write("b.yml", catalog_yaml("b"))
    catalog = load_dir(tmp_path)
    assert sorted(m.name for m in catalog.models) == ["a", "b"]
    assert catalog.resolve("x").name == "a"


def test_editor_scratch_files_and_subdirectories_are_not_read(tmp_path, write):
    write("a.yaml", catalog_yaml("a"))
    for scratch in (".a.yaml.swp", "a.yaml~", ".#a.yaml", "#a.yaml#", "a.yaml.tmp", "4913", "notes.txt", ".hidden.yaml"):
        write(scratch, "{{{ not yaml")
    (tmp_path / "drafts").mkdir()
    (tmp_path / "drafts" / "b.yaml").write_text("{{{ not yaml")
    assert [os.path.basename(f) for f in catalog_files(tmp_path)] == ["a.yaml"]
    assert [m.name for m in load_dir(tmp_path).models] == ["a"]


def test_emacs_lock_symlink_is_ignored(tmp_path, write):
    write("a.yaml", catalog_yaml("a"))
    os.symlink("user@host.1234:1700000000", tmp_path / ".#a.yaml")  # dangling, as emacs leaves it
    assert [m.name for m in load_dir(tmp_path).models] == ["a"]


def test_symlinked_files_are_followed_like_a_kubernetes_configmap(tmp_path):
    # ConfigMap volumes: catalog.yaml -> ..data/catalog.yaml, ..data -> ..2024_01_01_xx
    real = tmp_path / "..2024_01_01_00_00_00.1"
    real.mkdir()
    (real / "catalog.yaml").write_text(catalog_yaml("a"))
    os.symlink(real.name, tmp_path / "..data")
    os.symlink("..data/catalog.yaml", tmp_path / "catalog.yaml")
    assert [m.name for m in load_dir(tmp_path).models] == ["a"]


def test_empty_directory_is_rejected_like_an_empty_file(tmp_path):
    # Removing the last file (a bad `git rm`, a sync half done) must not tear
    # every model down; issue 13 item 12 turned this from "0 models" to an error.
    with pytest.raises(CatalogError, match="holds no \\*.yaml or \\*.yml catalog file"):
        load_dir(tmp_path)


def test_files_and_directories_together(tmp_path, write):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.yaml").write_text(catalog_yaml("a"))
    other = write("b.yaml", catalog_yaml("a"))
    with pytest.raises(CatalogError, match="name 'a' is already the name of model 'a'"):
        load_paths([tmp_path / "d", other])


def test_missing_path(tmp_path):
    with pytest.raises(CatalogError, match="no such file or directory"):
        load_paths([tmp_path / "nope.yaml"])


def test_defaults_and_values_as_written():
    catalog = load_text(HEADER + """
models:
  - name: qwen
    source: Qwen/Qwen2.5-7B-Instruct
    replicas: {min: 0, max: 4}
    idle_timeout: 1h30m
    profiles:
      - name: h100
        engine: vllm
        pool: h100
        gpus: 2
        priority: 10
        weight: 2
        args: [--max-model-len, 32768, --gpu-memory-utilization, 0.9]
        env: {VLLM_ATTENTION_BACKEND: FLASHINFER, NCCL_DEBUG: 1}
      - engine: llamacpp
        source: /models/qwen.gguf
        gpus: 0
  - name: tiny
    profiles: [{engine: fake}]
""")
    qwen = catalog.resolve("qwen")
    assert qwen.replicas.min == 0 and qwen.replicas.max == 4
    assert qwen.idle_timeout == 5400
    h100, cpu = qwen.profiles
    assert (h100.pool, h100.gpus, h100.priority, h100.weight) == ("h100", 2, 10, 2.0)
    assert h100.args == ("--max-model-len", "32768", "--gpu-memory-utilization", "0.9")
    assert dict(h100.env) == {"VLLM_ATTENTION_BACKEND": "FLASHINFER", "NCCL_DEBUG": "1"}
    assert cpu.name == "llamacpp" and cpu.source == "/models/qwen.gguf" and cpu.pool is None
    tiny = catalog.resolve("tiny")
    assert tiny.source == "tiny" and tiny.replicas.min == tiny.replicas.max == 1
    assert tiny.idle_timeout is None and tiny.profiles[0].gpus == 1


def test_custom_engine_is_usable_by_profiles():
    catalog = load_text(HEADER + """
engines:
  lmdeploy:
    command: [lmdeploy, serve, api_server, "{source}", --server-port, "{port}"]
    health: /health
models:
  - name: m
    profiles: [{engine: lmdeploy}]
""")
    engine = catalog.engines["lmdeploy"]
    assert engine.command[3] == "{source}" and not engine.builtin
    assert set(catalog.engines) >= {"vllm", "sglang", "llamacpp", "fake", "lmdeploy"}


def test_reformatting_and_comments_keep_the_version():
    a = load_text(catalog_yaml("a:x"))
    b = load_text("# a comment\n" + catalog_yaml("a:x").replace("[{engine: fake, gpus: 0}]", "\n      - engine: fake\n        gpus: 0"))
    assert a.version == b.version


def test_routing_policy_is_per_model_and_optional():
    text = HEADER + """
models:
  - name: chat
    routing: prefix
    profiles: [{engine: fake}]
  - name: plain
    profiles: [{engine: fake}]
"""
    catalog = load_text(text)
    assert catalog.resolve("chat").routing == "prefix"
    assert catalog.resolve("plain").routing is None     # the router's default
    # Written only when set, so catalogs without it keep their version.
    assert "routing" not in catalog.to_dict()["models"][1]
    assert load_text(text.replace("    routing: prefix\n", "")).version != catalog.version
    with pytest.raises(CatalogError, match=r"models\[0\]\.routing.*least-load"):
        load_text(text.replace("routing: prefix", "routing: prefix-cache"))


def test_stream_continuation_is_opt_in_per_model_with_bounded_attempts():
    text = HEADER + """
models:
  - name: chat
    continuation: true
    profiles: [{engine: fake}]
  - name: plain
    profiles: [{engine: fake}]
"""
    catalog = load_text(text)
    assert catalog.resolve("chat").continuation == 2       # true: the default count of hand-overs
    assert catalog.resolve("plain").continuation == 0      # off unless asked
    assert catalog.to_dict()["models"][0]["continuation"] is True
    assert "continuation" not in catalog.to_dict()["models"][1]
    assert load_text(text.replace("    continuation: true\n", "")).version != catalog.version
    assert load_text(text.replace("continuation: true", "continuation: false")).resolve("chat").continuation == 0
    three = load_text(text.replace("continuation: true", "continuation: {attempts: 3}"))
    assert three.resolve("chat").continuation == 3
    assert three.to_dict()["models"][0]["continuation"] == {"attempts": 3}
    for bad in ("continuation: {attempts: 0}", "continuation: {attempts: 11}", "continuation: yes please",
                "continuation: {tries: 2}"):
        with pytest.raises(CatalogError, match=r"models\[0\]\.continuation"):
            load_text(text.replace("continuation: true", bad))


def test_a_models_context_length_is_a_whole_number_of_tokens_kept_only_when_written():
    text = HEADER + """
models:
  - name: long
    context_length: 32768
    profiles: [{engine: fake}]
  - name: plain
    profiles: [{engine: fake}]
"""
    catalog = load_text(text)
    assert catalog.resolve("long").context_length == 32768 and catalog.resolve("plain").context_length is None
    assert catalog.to_dict()["models"][0]["context_length"] == 32768
    assert "context_length" not in catalog.to_dict()["models"][1]
    assert load_text(json.dumps(catalog.to_dict())).version == catalog.version
    for bad in ("0", "-1", "2147483648", "'4k'", "1.5", "true"):
        with pytest.raises(CatalogError, match=r"models\[0\]\.context_length"):
            load_text(text.replace("context_length: 32768", f"context_length: {bad}"))


def test_a_model_that_passed_the_schema_once_is_still_checked_where_it_changed_or_json_cannot_say_it():
    # Models that passed are remembered by their JSON text (issue 19: a 1,000-model
    # file is checked again on every edit of one model): the same model in a later
    # load passes without a check, a changed one is checked, and one that JSON cannot
    # say exactly -- a YAML `true` as a key reads as the text of the string "true" --
    # is checked every time, never taken for the one that passed.
    good = catalog_yaml("a", "b")
    load_text(good)
    broken = good.replace("  - name: b\n", "  - name: b\n    replicas: -1\n")
    with pytest.raises(CatalogError) as exc:
        load_text(broken)
    assert [p.path[:3] for p in exc.value.problems] == [("models", 1, "replicas")]
    env = "{engine: fake, gpus: 0, env: {%s: x}}"
    load_text(good.replace("{engine: fake, gpus: 0}", env % '"true"'))
    with pytest.raises(CatalogError) as exc:
        load_text(good.replace("{engine: fake, gpus: 0}", env % "true"))
    assert {p.path[:2] for p in exc.value.problems} == {("models", 0), ("models", 1)}
