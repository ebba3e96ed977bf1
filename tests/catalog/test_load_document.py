"""`load_document`: a catalog from a document already parsed (what a controller's watch sends) gets the file's checks."""
import json
import math
from pathlib import Path

import pytest
import yaml

from llmgwctl.catalog import CatalogError, load_document, load_text
from llmgwctl.catalog.loader import Limits

from .conftest import HEADER, catalog_yaml

BROKEN = Path(__file__).parent / "broken"
# What only text can be wrong in: the parsed document cannot hold it (a key
# twice is one key in a dict), or the case is about the file, not the document.
TEXT_ONLY = {"duplicate-key"}


def single_file_cases():
    for case in sorted(p for p in BROKEN.iterdir() if p.is_dir() and p.name not in TEXT_ONLY):
        files = sorted(case.glob("*.y*ml"))
        if len(files) != 1 or files[0].is_symlink():
            continue
        try:
            doc = yaml.safe_load(files[0].read_bytes())
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        if doc is None:
            continue
        yield pytest.param(files[0], doc, id=case.name)


def test_a_valid_document_is_the_catalog_its_text_is():
    text = catalog_yaml("a:x,y", "b")
    from_text = load_text(text)
    from_doc = load_document(yaml.safe_load(text), "<controller catalog>")
    assert from_doc.version == from_text.version and from_doc.to_dict() == from_text.to_dict()
    # And what the watch sends round-trips: Catalog.to_dict() through JSON.
    again = load_document(json.loads(json.dumps(from_text.to_dict())), "<controller catalog>")
    assert again.version == from_text.version


@pytest.mark.parametrize("path,doc", list(single_file_cases()))
def test_a_broken_document_gets_the_problems_its_file_gets_without_lines(path, doc):
    with pytest.raises(CatalogError) as from_text:
        load_text(path.read_bytes(), file="<source>")
    with pytest.raises(CatalogError) as from_doc:
        load_document(doc, "<source>")
    assert ([(p.file, p.path, p.message) for p in from_doc.value.problems]
            == [(p.file, p.path, p.message) for p in from_text.value.problems])
    assert all(p.line == 0 and p.column == 0 for p in from_doc.value.problems)


def test_a_problem_names_where_the_document_came_from_and_the_path_in_it():
    doc = yaml.safe_load(catalog_yaml("a"))
    doc["models"][0]["profiles"][0]["engine"] = "vlm"
    with pytest.raises(CatalogError) as info:
        load_document(doc, "<controller http://127.0.0.1:8081 catalog>")
    (problem,) = info.value.problems
    assert str(problem).startswith("<controller http://127.0.0.1:8081 catalog>: models[0].profiles[0].engine: ")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_number_that_is_not_finite_is_refused_as_in_a_file(value):
    doc = yaml.safe_load(catalog_yaml("a"))
    doc["models"][0]["profiles"][0]["weight"] = value
    with pytest.raises(CatalogError, match=r"models\[0\]\.profiles\[0\]\.weight: .* is not a finite number"):
        load_document(doc)


def test_the_limits_hold_for_a_document_too():
    deep: dict = {}
    inner = deep
    for _ in range(100):
        inner["x"] = {}
        inner = inner["x"]
    with pytest.raises(CatalogError, match="nested more than 64 levels deep"):
        load_document(dict(yaml.safe_load(HEADER + "models: []\n"), extra=deep))
    with pytest.raises(CatalogError, match="holds more than 10 values"):
        load_document(yaml.safe_load(catalog_yaml("a", "b")), limits=Limits(max_nodes=10))
    with pytest.raises(CatalogError, match="expected a mapping"):
        load_document(["not", "a", "catalog"])
