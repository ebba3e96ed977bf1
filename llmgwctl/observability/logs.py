"""Log setup for every long-running command: human-readable by default, JSON for collectors.

One line per event a person cares about. Pieces log through the standard
`logging` module under `llmgw.*` names and pass `extra={"event": kind}` for the
events a collector should be able to filter on (catalog-swapped,
replica-ready, node-lost, ...); the JSON format turns every `extra` field
into a key, the text format ignores them (the message already says it all).

It must not know which pieces log what.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

# The attributes every LogRecord has; anything else on a record came from
# `extra=` and belongs in the JSON object.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601 with ms), level, logger, msg, then any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(verbose: int = 0, fmt: str = "text", *, level: str | None = None,
                  stream: TextIO | None = None) -> None:
    """Configure the root logger once per process.

    `verbose`: 0 info, 1 info (with aiohttp's own access log), 2+ debug.
    `level` ("debug", "info", "warning", "error") overrides `verbose` when given.
    `fmt`: "text" or "json". Logs go to stderr, so a command's stdout stays
    for what scripts read (the router's "listening on" line).
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if level else (logging.DEBUG if verbose > 1 else logging.INFO))
    # Python's warnings (a deprecation in a library, say) are written to stderr
    # by the warnings module itself, bypassing the handler: routed through
    # logging ("py.warnings"), they come out in the chosen format too.
    logging.captureWarnings(True)
    if verbose < 2 and not (level and level.lower() == "debug"):
        # aiohttp's own access log duplicates ours (the router writes its own,
        # with model and replica) and the control API's long-polls would flood it.
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def stdout_line(message: str, fmt: str, *, logger: str, **fields: object) -> str:
    """A line for stdout that a parent process reads (the bound port), in the log format in force.

    With json, even this line is a JSON object (the message, `event` and the
    fields as keys), so a collector reading everything the process prints
    sees no plain text; the message stays the same words, so a reader that
    searches for them finds them in either format.
    """
    if fmt != "json":
        return message
    record = logging.LogRecord(logger, logging.INFO, __file__, 0, message, None, None)
    record.__dict__.update(fields)
    return JsonFormatter().format(record)
