"""A catalog repository is trusted to describe the fleet, not to crash it (issue 13, catalog items).

Each test is one thing a careless operator or an attacker with write access
to the catalog could put there; each was accepted, hung or crashed the
loader at b616774. Every rejection names file:line:col where there is a
line, and quotes no more than a short excerpt of the file.
"""
import os
import threading

import pytest

from llmgwctl.catalog import CatalogError, load_dir, load_text
from llmgwctl.catalog.bounds import MAX_REPLICAS
from llmgwctl.catalog.loader import EXCERPT, Limits

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\n"
GOOD = HEADER + "models:\n  - name: good\n    profiles: [{engine: fake, gpus: 0}]\n"


def model(extra: str = "", profile: str = "") -> str:
    return HEADER + f"models:\n  - name: m\n{extra}    profiles: [{{engine: fake, gpus: 0{profile}}}]\n"


def problems(directory) -> list[str]:
    with pytest.raises(CatalogError) as info:
        load_dir(directory)
    return [str(p).replace(f"{directory}{os.sep}", "") for p in info.value.problems]


@pytest.mark.parametrize("extra,profile,where,words", [
    ("    replicas: 99999999999999999999999999\n", "", "m.yaml:5:15: models[0].replicas:", f"at most {MAX_REPLICAS}"),
    ("    replicas: {min: 1, max: 5000}\n", "", "m.yaml:5:29: models[0].replicas.max:", f"at most {MAX_REPLICAS}"),
    ("    idle_timeout: .nan\n", "", "m.yaml:5:19: models[0].idle_timeout:", "not a finite number"),
    ("    idle_timeout: .inf\n", "", "m.yaml:5:19: models[0].idle_timeout:", "not a finite number"),
    ("    idle_timeout: " + "9" * 400 + "d\n", "", "m.yaml:5:19: models[0].idle_timeout:", "longer than 64 characters"),
    ("    idle_timeout: 400d\n", "", "m.yaml:5:19: models[0].idle_timeout:", "365d"),
    ("", ", weight: .nan", "m.yaml:5:48: models[0].profiles[0].weight:", "not a finite number"),
    ("", ", weight: -.inf", "m.yaml:5:48: models[0].profiles[0].weight:", "not a finite number"),
    ("", ", weight: 1.0e+999", "m.yaml:5:48: models[0].profiles[0].weight:", "not a finite number"),
    ("", ", priority: 10000000000", "m.yaml:5:50: models[0].profiles[0].priority:", "at most 1000000"),
])
def test_every_number_is_finite_and_bounded(tmp_path, extra, profile, where, words):
    (tmp_path / "m.yaml").write_text(model(extra, profile))
    found = problems(tmp_path)
    assert any(p.startswith(where) and words in p for p in found), found


def test_a_catalog_built_in_code_is_bounded_too():
    # The rules hold in the Catalog constructor, not only in the schema.
    from llmgwctl.catalog import Catalog, Model, Profile, Replicas
    with pytest.raises(CatalogError, match="not a finite|finite number"):
        Catalog([Model("m", (Profile("p", "fake", gpus=0, weight=float("nan")),))])
    with pytest.raises(CatalogError, match="at most 1000 replicas"):
        Catalog([Model("m", (Profile("p", "fake", gpus=0),), replicas=Replicas(1, 10**20))])
    with pytest.raises(CatalogError, match="365d"):
        Catalog([Model("m", (Profile("p", "fake", gpus=0),), idle_timeout=float("inf"))])


def test_the_whole_catalog_wants_a_bounded_number_of_replicas(tmp_path):
    body = "".join(f"  - name: m{i}\n    replicas: {MAX_REPLICAS}\n    profiles: [{{engine: fake, gpus: 0}}]\n"
                   for i in range(101))
    (tmp_path / "m.yaml").write_text(HEADER + "models:\n" + body)
    assert any("more than 100000 replicas together" in p for p in problems(tmp_path))


def alias_bomb() -> str:
    # 9 levels of 9 aliases: ~1 KB of text, 9**9 = 387 million nodes expanded.
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join(f"*a{i - 1}" for _ in range(9)) + "]")
    return HEADER + "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    text = alias_bomb()
    assert len(text) < 1100
    (tmp_path / "bomb.yaml").write_text(text)
    done: list = []
    worker = threading.Thread(target=lambda: done.append(problems(tmp_path)), daemon=True)
    worker.start()
    worker.join(20)   # at b616774 the walk grew to 4.3 GB; refused it takes milliseconds
    assert done, "the alias bomb was not refused within 20 s"
    (found,) = done
    assert any("bomb.yaml:" in p and "YAML nodes" in p and "alias" in p for p in found), found


def test_aliases_within_the_budget_still_work(tmp_path):
    (tmp_path / "m.yaml").write_text(HEADER + "models:\n"
                                     "  - name: a\n    profiles: [&p {engine: fake, gpus: 0, env: &e {A: '1'}}]\n"
                                     "  - name: b\n    profiles: [*p]\n")
    catalog = load_dir(tmp_path)
    assert [m.name for m in catalog.models] == ["a", "b"]


def test_recursive_and_deep_documents_are_refused_not_crashed(tmp_path):
    (tmp_path / "deep.yaml").write_text(HEADER + "models: " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "block.yaml").write_text(HEADER + "".join("  " * i + "a:\n" for i in range(70)) + "  " * 70 + "b: 1\n")
    (tmp_path / "loop.yaml").write_text(HEADER + "models: &x [*x]\n")
    found = problems(tmp_path)   # a libyaml without a depth limit segfaults composing the first
    assert any(p.startswith("deep.yaml:3:") and "nest" in p for p in found), found
    assert any(p.startswith("block.yaml:") and "nested more than 64 levels" in p for p in found), found
    assert any(p.startswith("loop.yaml:3:") and "cannot be recursive" in p for p in found), found


def test_a_fifo_is_refused_without_blocking(tmp_path):
    (tmp_path / "good.yaml").write_text(GOOD)
    os.mkfifo(tmp_path / "x.yaml")
    done: list = []
    worker = threading.Thread(target=lambda: done.append(problems(tmp_path)), daemon=True)
    worker.start()
    worker.join(20)
    assert done, "reading the catalog blocked on a FIFO"
    assert any("x.yaml: is a FIFO" in p and "only regular files are read" in p for p in done[0]), done[0]


@pytest.mark.parametrize("target", ["/dev/zero", "/etc/passwd"])
def test_a_link_out_of_the_directory_is_refused_unread(tmp_path, target):
    (tmp_path / "good.yaml").write_text(GOOD)
    os.symlink(target, tmp_path / "x.yaml")
    found = problems(tmp_path)
    assert any("x.yaml: is a symlink to" in p and "outside the catalog directory" in p for p in found), found
    assert "root:" not in "\n".join(found)


def test_a_secret_inside_the_directory_is_never_quoted_whole(tmp_path):
    # A token file saved as .yaml by mistake: the error may point at it, never print it.
    secret = "llmgw-admin-" + "s3cr3t" * 20
    (tmp_path / "token.yaml").write_text(secret + "\n")
    (tmp_path / "other.yaml").write_text(HEADER + f"models:\n  - name: m\n    source: x\n    {secret}: 1\n"
                                         "    profiles: [{engine: fake}]\n")
    text = "\n".join(problems(tmp_path))
    assert secret not in text
    assert all(len(line) < 400 for line in text.splitlines())
    assert "s3cr3t" * (EXCERPT // 6 + 1) not in text


def test_kubernetes_configmap_links_are_followed(tmp_path):
    # The layout kubelet mounts: x.yaml -> ..data/x.yaml, ..data -> ..2024_01_01_00_00_00.1, the real files.
    stamp = tmp_path / "..2024_01_01_00_00_00.1"
    stamp.mkdir()
    (stamp / "models.yaml").write_text(GOOD)
    os.symlink(stamp.name, tmp_path / "..data")
    os.symlink("..data/models.yaml", tmp_path / "models.yaml")
    assert [m.name for m in load_dir(tmp_path).models] == ["good"]
    # ...and through a directory that is itself a link (as /etc/llmgw/catalogs often is).
    os.symlink(tmp_path, tmp_path.parent / "linked-catalogs")
    assert [m.name for m in load_dir(tmp_path.parent / "linked-catalogs").models] == ["good"]


def test_files_and_directory_have_size_caps(tmp_path):
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "big.yaml").write_text(GOOD.replace("good", "big") + "#" * 5000 + "\n")
    with pytest.raises(CatalogError, match="big.yaml: file is larger than"):
        load_dir(tmp_path, limits=Limits(max_file_bytes=4096))
    with pytest.raises(CatalogError, match="add up to more than"):
        load_dir(tmp_path, limits=Limits(max_dir_bytes=4096))
    assert len(load_dir(tmp_path)) == 2   # the default caps are generous


def test_an_emptied_directory_is_rejected_like_an_empty_file(tmp_path):
    assert any("holds no *.yaml or *.yml catalog file" in p for p in problems(tmp_path))


def test_a_nul_byte_is_reported_at_its_line_and_column(tmp_path):
    (tmp_path / "m.yaml").write_text(HEADER + "models:\n  - name: m\x00x\n")
    assert problems(tmp_path) == ["m.yaml:4:12: control character U+0000 (NUL) is not allowed in YAML; "
                                  "remove it (a binary file, or a paste gone wrong?)"]


def test_schema_durations_and_rules_are_reported_in_one_round(tmp_path):
    # At b616774 this took three rounds of validate: the schema error hid the
    # model's bad duration and its unknown engine, the duplicate key hid all.
    (tmp_path / "a.yaml").write_text(HEADER + "models:\n"
                                     "  - name: a\n    idle_timeout: 15 minutes\n    replicas: {min: 1, max: x}\n"
                                     "    profiles: [{engine: vlm}]\n"
                                     "  - name: b\n    name: b\n    profiles: [{engine: fake, weight: .nan}]\n")
    found = problems(tmp_path)
    assert any("models[0].replicas: expected an integer" in p for p in found), found
    assert any("models[0].idle_timeout: expected a duration" in p for p in found), found
    assert any("models[0].profiles[0].engine: 'vlm' is not one of" in p for p in found), found
    assert any("models[1].name: key 'name' appears twice" in p for p in found), found
    assert any("models[1].profiles[0].weight" in p and "finite" in p for p in found), found


def test_a_posted_document_gets_the_same_rules():
    with pytest.raises(CatalogError, match="not a finite number"):
        load_text(model("    idle_timeout: .nan\n"))
    with pytest.raises(CatalogError, match="document is larger than"):
        load_text(GOOD + "#" * 5000, limits=Limits(max_file_bytes=4096))
