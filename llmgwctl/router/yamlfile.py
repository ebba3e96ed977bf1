"""Reading one of the router's own YAML files (API keys, static endpoints) into a document.

Both files are read the same way and fail the same way: a message naming the
file and what was wrong, raised as that file's own error (a `RouterError`), so
the caller keeps its last good contents and the operator sees which file.
"""
from __future__ import annotations

import os
from typing import Any

import yaml


def load_yaml(path: str | os.PathLike, error: type[Exception]) -> Any:
    """The parsed document in `path` (UTF-8), or `error` saying it cannot be read or is not YAML."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None
