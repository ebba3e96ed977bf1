"""`catalog apply`: validate a file as part of the directory, plan what it changes, write it atomically.

Applying never swaps a catalog itself. It writes the file into the catalog
directory (temp file + rename, so the directory never holds half a file) and
lets the watcher take it like any other edit: one path for every change.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from .. import fsutil
from ..catalog import Catalog, CatalogError, Problem, load_dir
from ..catalog.diff import diff
from ..catalog.loader import is_catalog_file
from .errors import ControlError

log = logging.getLogger("llmgw.control")


class ApplyError(ControlError, ValueError):
    """The request itself is wrong (not the catalog): a bad file name, an empty body."""


def check_filename(filename: str) -> str:
    name = os.path.basename(filename or "")
    if not name or name != filename or not is_catalog_file(name):
        raise ApplyError(f"file name {filename!r} must be a plain *.yaml or *.yml name, not hidden, without a directory")
    return name


def decode_content(content: str) -> bytes:
    """The UTF-8 bytes of a posted document; ApplyError for text JSON allows but UTF-8 cannot hold (a lone surrogate)."""
    try:
        return content.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApplyError(f"content is not valid Unicode text: {exc.reason} at character {exc.start}") from None


def validate_with(directory: str, filename: str, content: bytes) -> Catalog:
    """The catalog `directory` would hold with `filename` set to `content`; CatalogError naming real paths.

    The directory is read as the watcher reads it (same limits, same refusal
    of FIFOs and links out of it), with `content` in place of the file, so
    nothing is copied and a FIFO in the directory cannot block the copy.
    """
    name = check_filename(filename)
    try:
        return load_dir(directory, replace={name: content})
    except CatalogError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a bug in a rule must answer 422 with a reason, not a bare 500
        log.exception("validating %s for catalog apply failed unexpectedly", name)
        raise CatalogError([Problem(os.path.join(directory, name), (),
                                    f"could not be validated ({type(exc).__name__}: {str(exc)[:200]}); "
                                    "this is a bug in llmgw, the server log has the traceback")]) from None


def write_atomically(directory: str, filename: str, content: bytes) -> str:
    name = check_filename(filename)
    final = os.path.join(directory, name)
    fsutil.write_atomically(final, content)
    return final


def plan(current: Catalog, new: Catalog, preview: dict[str, Any]) -> dict[str, Any]:
    return {"from_version": current.version, "to_version": new.version, "diff": diff(current, new).to_dict(),
            "replicas": preview}
