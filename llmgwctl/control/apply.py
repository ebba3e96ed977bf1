"""`catalog apply`: validate a file as part of the directory, plan what it changes, write it atomically.

Applying never swaps a catalog itself. It writes the file into the catalog
directory (temp file + rename, so the directory never holds half a file) and
lets the watcher take it like any other edit: one path for every change.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from .. import fsutil
from ..catalog import Catalog, CatalogError, Problem, load_dir
from ..catalog.diff import diff
from ..catalog.loader import catalog_files, is_catalog_file
from .errors import ControlError


class ApplyError(ControlError, ValueError):
    """The request itself is wrong (not the catalog): a bad file name, an empty body."""


def check_filename(filename: str) -> str:
    name = os.path.basename(filename or "")
    if not name or name != filename or not is_catalog_file(name):
        raise ApplyError(f"file name {filename!r} must be a plain *.yaml or *.yml name, not hidden, without a directory")
    return name


def validate_with(directory: str, filename: str, content: bytes) -> Catalog:
    """The catalog `directory` would hold with `filename` set to `content`; CatalogError naming real paths."""
    name = check_filename(filename)
    with tempfile.TemporaryDirectory(prefix="llmgw-apply-") as scratch:
        for path in catalog_files(directory):
            if os.path.basename(path) != name:
                try:
                    shutil.copyfile(path, os.path.join(scratch, os.path.basename(path)))
                except OSError:
                    continue  # vanished meanwhile, or a broken link: the watcher reports those
        with open(os.path.join(scratch, name), "wb") as f:
            f.write(content)
        try:
            return load_dir(scratch)
        except CatalogError as exc:
            # Errors name the files as the operator knows them, not our scratch copy.
            real = directory.rstrip(os.sep) or os.sep
            raise CatalogError(Problem(p.file.replace(scratch, real, 1), p.path, p.message.replace(scratch, real),
                                       p.line, p.column) for p in exc.problems) from None


def write_atomically(directory: str, filename: str, content: bytes) -> str:
    name = check_filename(filename)
    final = os.path.join(directory, name)
    fsutil.write_atomically(final, content)
    return final


def plan(current: Catalog, new: Catalog, preview: dict[str, Any]) -> dict[str, Any]:
    return {"from_version": current.version, "to_version": new.version, "diff": diff(current, new).to_dict(),
            "replicas": preview}
