"""Every rule the loader enforces, each as a broken catalog directory with the exact message it must print.

Each case under broken/ is a directory as an operator would have it; its
expected.txt holds the lines `llmgwctl catalog validate .` prints (file:line:col:
path: message), in order. A change in wording or position shows up here.
"""
import os
from pathlib import Path

import pytest

from llmgwctl.catalog import CatalogError, load_dir

CASES = sorted(p for p in (Path(__file__).parent / "broken").iterdir() if p.is_dir())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_broken_catalog_is_rejected_with_its_message(case, monkeypatch):
    monkeypatch.chdir(case)
    with pytest.raises(CatalogError) as info:
        load_dir(".")
    expected = (case / "expected.txt").read_text().splitlines()
    assert [str(p) for p in info.value.problems] == expected


def test_corpus_covers_every_rule():
    # The rules the issue names; if one is dropped from the corpus this fails.
    names = {c.name for c in CASES}
    assert {"duplicate-name-across-files", "duplicate-alias-across-files", "alias-is-another-models-name",
            "unknown-engine", "duplicate-profile-names", "min-greater-than-max", "bad-duration",
            "yaml-syntax", "empty-file", "not-a-mapping", "not-utf8", "broken-symlink",
            "many-errors-at-once", "fallback-cycle-across-files", "fallback-unknown-or-self"} <= names


def test_all_errors_of_a_directory_are_reported_at_once():
    case = Path(__file__).parent / "broken" / "many-errors-at-once"
    with pytest.raises(CatalogError) as info:
        load_dir(case)
    assert len(info.value.problems) == 4
    assert {os.path.basename(p.file) for p in info.value.problems} == {"a.yaml", "b.yaml"}
