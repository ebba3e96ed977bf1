"""Catalog limits the loader meets: each list and the whole catalog bounded where validating them costs.

At 48de24a a 13.7 MB catalog within every documented limit took 44 s and
~500 MB to validate, and a reload of one file among 10,000 read all of them.
Each limit here is refused just past it (file:line, the limit named) and
accepted just under it; a reload reads only the file that changed (counted
by the loader's cache, not timed).
"""
from __future__ import annotations

import gc
import os
import time

import pytest

from llmgwctl.catalog import CatalogError, files, load_dir, load_text, loader
from llmgwctl.catalog.loader import DEFAULT_LIMITS, FileCache, Limits

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\n"


def problems(directory) -> list[str]:
    with pytest.raises(CatalogError) as info:
        load_dir(directory)
    return [str(p).replace(f"{directory}{os.sep}", "") for p in info.value.problems]


def one_model(profile: str = "{engine: fake, gpus: 0}", extra: str = "") -> str:
    return HEADER + f"models:\n  - name: m\n{extra}    profiles: [{profile}]\n"


def items(n: int, fmt: str) -> str:
    return ", ".join(fmt.format(i=i) for i in range(n))


# (what, YAML for n items, the limit, where the problem is, its words)
LISTS = [
    ("aliases", lambda n: one_model(extra=f"    aliases: [{items(n, 'a{i}')}]\n"), 256,
     "m.yaml:5:14: models[0].aliases:", "more than 256 items"),
    ("profiles", lambda n: HEADER + f"models:\n  - name: m\n    profiles: [{items(n, '{{name: p{i}, engine: fake, gpus: 0}}')}]\n"),
    ("args", lambda n: one_model("{engine: fake, gpus: 0, args: [" + items(n, "a{i}") + "]}"), 256,
     "m.yaml:5:46: models[0].profiles[0].args:", "more than 256 items"),
    ("env", lambda n: one_model("{engine: fake, gpus: 0, env: {" + items(n, "K{i}: v") + "}}"), 256,
     "m.yaml:5:45: models[0].profiles[0].env:", "more than 256 entries"),
    ("engines", lambda n: HEADER + "engines:\n" + "".join(f"  e{i}: {{command: [x]}}\n" for i in range(n)), 64,
     "m.yaml:4:3: engines:", "more than 64 entries"),
    ("command", lambda n: HEADER + f"engines:\n  e: {{command: [{items(n, 'x{i}')}]}}\n", 256,
     "m.yaml:4:16: engines.e.command:", "more than 256 items"),
]
LISTS[1] = LISTS[1] + (32, "m.yaml:5:15: models[0].profiles:", "more than 32 items")


@pytest.mark.parametrize("what, text, limit, where, words", LISTS, ids=[x[0] for x in LISTS])
def test_each_list_is_refused_past_its_limit_and_taken_at_it(tmp_path, what, text, limit, where, words):
    (tmp_path / "m.yaml").write_text(text(limit + 1))
    found = problems(tmp_path)
    assert any(p.startswith(where) and words in p for p in found), found
    (tmp_path / "m.yaml").write_text(text(limit) + ("" if what not in ("engines", "command") else
                                                     "models: [{name: m, profiles: [{engine: fake, gpus: 0}]}]\n"))
    load_dir(tmp_path)


@pytest.mark.parametrize("field, limit", [("source", 4096)])
def test_long_strings_are_refused(tmp_path, field, limit):
    (tmp_path / "m.yaml").write_text(one_model(extra=f"    {field}: {'x' * (limit + 1)}\n"))
    found = problems(tmp_path)
    assert any(p.startswith("m.yaml:5:13: models[0].source:") and f"longer than {limit}" in p for p in found), found
    (tmp_path / "m.yaml").write_text(one_model(extra=f"    {field}: {'x' * limit}\n"))
    load_dir(tmp_path)


def models_file(first: int, n: int) -> str:
    return HEADER + "models:\n" + "".join(f"  - {{name: m{i}, replicas: 0, profiles: [{{engine: fake}}]}}\n"
                                          for i in range(first, first + n))


def test_one_file_holds_a_bounded_number_of_models(tmp_path):
    limit = loader._models_per_file()
    (tmp_path / "m.yaml").write_text(models_file(0, limit + 1))
    assert problems(tmp_path) == [f"m.yaml:4:3: models: has more than {limit} items, the most one file may hold; "
                                  "split the catalog into more files"]
    with pytest.raises(CatalogError, match=f"more than {limit} items"):
        load_text(models_file(0, limit + 1))


def test_the_whole_catalog_holds_a_bounded_number_of_models(tmp_path):
    limits = Limits(max_models=30)
    (tmp_path / "a.yaml").write_text(models_file(0, 20))
    (tmp_path / "b.yaml").write_text(models_file(20, 10))
    assert len(load_dir(tmp_path, limits=limits)) == 30
    (tmp_path / "c.yaml").write_text(models_file(30, 1))
    with pytest.raises(CatalogError) as info:
        load_dir(tmp_path, limits=limits)
    assert [str(p).replace(f"{tmp_path}{os.sep}", "") for p in info.value.problems] == [
        "c.yaml: the catalog's files hold more than 30 models together with this one, the most one catalog may hold"]


def test_the_default_limits_are_the_ones_documented():
    # man/llmgw-catalog.5 states them; a change here is a change there.
    assert (DEFAULT_LIMITS.max_file_bytes, DEFAULT_LIMITS.max_dir_bytes) == (2 << 20, 8 << 20)
    assert (DEFAULT_LIMITS.max_nodes, DEFAULT_LIMITS.max_models) == (200_000, 10_000)
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "man", "llmgw-catalog.5"), encoding="utf-8").read()
    for words in ("2 MiB", "8 MiB", "200,000 YAML nodes", "10,000 models", "5,000"):
        assert words in text, words


def test_the_node_budget_is_directory_wide(tmp_path):
    limits = Limits(max_nodes=2_000)
    (tmp_path / "a.yaml").write_text(models_file(0, 150))       # ~8 nodes a model
    load_dir(tmp_path, limits=limits)
    (tmp_path / "b.yaml").write_text(models_file(150, 150))
    with pytest.raises(CatalogError, match="b.yaml: the catalog's files hold more than 2000 YAML nodes"):
        load_dir(tmp_path, limits=limits)


def test_a_load_past_its_time_gives_up_and_says_so(tmp_path):
    (tmp_path / "a.yaml").write_text(models_file(0, 10))
    with pytest.raises(CatalogError, match="took longer than 0 s"):
        load_dir(tmp_path, limits=Limits(max_seconds=0))


def test_the_collector_is_paused_during_a_load_and_back_after(tmp_path):
    (tmp_path / "a.yaml").write_text(models_file(0, 10))
    seen = []
    original = loader._assemble

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    loader._assemble = spy
    try:
        assert gc.isenabled()
        load_dir(tmp_path)
    finally:
        loader._assemble = original
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        load_dir(tmp_path)
        assert not gc.isenabled()           # one that was off stays off
    finally:
        gc.enable()


def old(path, seconds: float = 60) -> None:
    """Make `path` look written `seconds` ago, past the window where its stat cannot be trusted."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_reload_reads_only_the_file_that_changed(tmp_path):
    for i in range(200):
        (tmp_path / f"m{i:03d}.yaml").write_text(models_file(i, 1))
    # ctime cannot be set back, so the racy window is what this test moves.
    for f in tmp_path.iterdir():
        old(f)
    cache = FileCache()
    saved = files.RACY_NS
    files.RACY_NS = 0
    try:
        first = load_dir(tmp_path, cache=cache)
        assert (cache.reads, cache.parses) == (200, 200)
        assert load_dir(tmp_path, cache=cache).version == first.version
        assert (cache.reads, cache.parses, cache.unchanged) == (200, 200, 200)   # nothing read again

        (tmp_path / "m007.yaml").write_text(models_file(7, 1).replace("replicas: 0", "replicas: 1"))
        changed = load_dir(tmp_path, cache=cache)
        assert (cache.reads, cache.parses) == (201, 201)
        assert changed.resolve("m7").replicas.min == 1 and changed.version != first.version

        # Touched but the same: read (its stat changed) but not parsed again.
        (tmp_path / "m008.yaml").write_text(models_file(8, 1))
        load_dir(tmp_path, cache=cache)
        assert (cache.reads, cache.parses) == (202, 201)

        # The whole-catalog rules still run over the union: a name taken in another file.
        (tmp_path / "m009.yaml").write_text(models_file(10, 1))
        with pytest.raises(CatalogError, match="'m10' is already the name of model 'm10'"):
            load_dir(tmp_path, cache=cache)
        assert cache.reads == 203
    finally:
        files.RACY_NS = saved


def test_a_file_changed_within_the_racy_window_is_read_again(tmp_path):
    # Same size, same mtime (set back by a tool): only a file older than the
    # window when it was read is trusted by its stat; this one was just written.
    path = tmp_path / "m.yaml"
    path.write_text(models_file(0, 1))
    cache = FileCache()
    load_dir(tmp_path, cache=cache)
    st = os.stat(path)
    path.write_text(models_file(0, 1).replace("m0", "n0"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert load_dir(tmp_path, cache=cache).resolve("n0") is not None
    assert cache.reads == 2


def test_a_stat_is_trusted_only_for_a_while(tmp_path):
    now = [1000.0]
    path = tmp_path / "m.yaml"
    path.write_text(models_file(0, 1))
    old(path)
    cache = FileCache(clock=lambda: now[0])
    saved = files.RACY_NS
    files.RACY_NS = 0
    try:
        load_dir(tmp_path, cache=cache)
        load_dir(tmp_path, cache=cache)
        assert cache.reads == 1
        now[0] += loader.TRUST_STAT_FOR + 1
        load_dir(tmp_path, cache=cache)
        assert cache.reads == 2
    finally:
        files.RACY_NS = saved
