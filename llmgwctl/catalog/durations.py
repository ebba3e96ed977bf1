"""Durations as operators write them: `30s`, `15m`, `1h30m`, `2d`, `500ms`, or a number of seconds."""
from __future__ import annotations

import math
import re

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
# Rendering walks the units largest first so `5400` prints as `1h30m`, which is
# what an operator would have written, and parses back to the same number.
_RENDER = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))

EXPECTED = "a duration like 30s, 15m, 1h30m or 2d (or a number of seconds)"


def parse_duration(value: object) -> float:
    """Seconds in `value`; ValueError naming what was expected when it is not a duration."""
    if isinstance(value, bool):
        raise ValueError(f"expected {EXPECTED}, got {value!r}")
    if isinstance(value, (int, float)):
        # NaN compares false with everything, so it would slip past `< 0` and
        # every bound after it; inf would reach `format_duration` and raise there.
        if not math.isfinite(value):
            raise ValueError(f"expected {EXPECTED}, got {value!r}, which is not a finite number")
        if value < 0:
            raise ValueError(f"expected {EXPECTED}, got a negative number {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected {EXPECTED}, got {type(value).__name__}")
    text = value.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return parse_duration(float(text))
    pos, total = 0, 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        number, unit = float(match.group(1)), match.group(2)
        # Dividing by 1000 (not multiplying by 0.001) keeps `235ms` exactly 0.235.
        total += number / 1000 if unit == "ms" else number * _UNITS[unit]
        pos = match.end()
    if not text or pos != len(text):
        raise ValueError(f"expected {EXPECTED}, got {_excerpt(value)}")
    if not math.isfinite(total):
        # 400 nines and a unit are digits the regex accepts and float() makes inf.
        raise ValueError(f"expected {EXPECTED}, got {_excerpt(value)}, which is too large to be a time")
    return total


def _excerpt(value: str, limit: int = 40) -> str:
    # An error names what it got, but never more than a short excerpt of it.
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."


def format_duration(seconds: float) -> str:
    """The shortest usual spelling of `seconds`; `parse_duration` reads it back exactly."""
    if not math.isfinite(seconds):
        # A Catalog never holds one (its rules refuse it); this keeps a caller's
        # stray value printable instead of an exception from int().
        return str(seconds)
    if seconds == 0:
        return "0s"
    if seconds != int(seconds):
        millis = round(seconds * 1000)
        if millis == seconds * 1000:
            return f"{millis}ms"
        return f"{seconds}s"
    rest, out = int(seconds), ""
    for unit, size in _RENDER:
        if rest >= size:
            out += f"{rest // size}{unit}"
            rest %= size
    return out
