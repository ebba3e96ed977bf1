"""What a catalog-defined engine's command and routes may hold: placeholders, shell strings, client routes.

The rules a `Catalog` applies to each `EngineSpec` it did not build in
(`check_engine`), and the two facts `engines.custom` needs when it fills a
command per replica (`TEMPLATE_FIELDS`, `shell_strings`). Pure functions of
strings: it imports nothing of llmgw's but the spec's type.
"""
from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import EngineSpec

# Placeholders an engine command template may use; anything else in braces is a
# typo that would otherwise reach the engine's command line verbatim.
TEMPLATE_FIELDS = frozenset({"source", "port", "host", "model", "gpus"})
# Programs whose `-c STRING` is shell code. A placeholder there is filled
# shlex-quoted (llmgwctl.engines.custom), since `source: "x; touch INJECTED #"`
# would otherwise run as a second command; everywhere else a placeholder only
# ever fills one argv element, which no shell reads.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox"})
# Engine routes that change the engine for every client -- loading adapters,
# sleeping, shutting down, dropping caches, profiling, swapping weights --
# which an engine's `routes` may never name: the router never proxies them
# (router.routes), and the catalog must not open them either. Matched on any
# path segment, so `/v1/load_lora_adapter` and a future `/v2/sleep` both are.
ADMIN_ROUTE_WORDS = ("lora", "adapter", "sleep", "wake", "shutdown", "reset", "flush", "cache", "profile",
                     "weights", "collective_rpc", "rpc", "abort", "pause", "resume", "scale", "slots",
                     "memory_occupation", "configure", "debug", "admin", "expert_distribution", "kill")
# Client routes an engine may add: under /v1/ (where the router proxies), a
# few plain segments, nothing the router answers itself.
ENGINE_ROUTE = re.compile(r"/v1(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}){1,4}")


def shell_strings(command: Iterable[str]) -> frozenset[int]:
    """Indexes of the elements of `command` that a shell runs as code: what follows `-c` (or `-ec`, `-lc`...) after a shell."""
    command = list(command)
    out: set[int] = set()
    shell_at = None
    for i, part in enumerate(command):
        if shell_at is None:
            if part.rsplit("/", 1)[-1] in SHELLS:
                shell_at = i
            continue
        if part.startswith("-") and not part.startswith("--") and "c" in part[1:] and i + 1 < len(command):
            out.add(i + 1)
            shell_at = None
    return frozenset(out)


def _quoted_fields(part: str) -> list[str]:
    """Placeholders of a shell string that sit inside quotes, where a shlex-quoted value would break out again."""
    out, state, escaped = [], None, False
    for literal, name, _, _ in string.Formatter().parse(part):
        for ch in literal:
            if escaped:
                escaped = False
            elif state == "'":
                state = None if ch == "'" else state
            elif ch == "\\":
                escaped = True
            elif state == '"':
                state = None if ch == '"' else state
            elif ch in "'\"":
                state = ch
        if name is not None and state is not None:
            out.append(name)
    return out


def check_engine(spec: EngineSpec) -> Iterable[tuple[tuple[str | int, ...], str]]:
    if not spec.command:
        yield ("command",), "a catalog-defined engine needs a command"
    shells = shell_strings(spec.command)   # once: per element it was quadratic in the command's length
    for i, part in enumerate(spec.command):
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(part) if f is not None}
        except ValueError as exc:
            yield ("command", i), f"bad template {part!r}: {exc}"
            continue
        unknown = sorted(f for f in fields if f not in TEMPLATE_FIELDS)
        if unknown:
            yield ("command", i), (f"unknown placeholder {{{unknown[0]}}}; expected one of "
                                   + ", ".join("{" + f + "}" for f in sorted(TEMPLATE_FIELDS)))
        elif i in shells:
            quoted = _quoted_fields(part)
            if quoted:
                yield ("command", i), (f"placeholder {{{quoted[0]}}} is inside quotes in a shell string; write it "
                                       "bare: llmgw fills it shell-quoted, and a quote around that would undo it")
    for key in ("health", "metrics"):
        value = getattr(spec, key)
        if value is not None and not value.startswith("/"):
            yield (key,), f"expected a path starting with '/', got {value!r}"
    for i, route in enumerate(spec.routes):
        problem = engine_route_problem(route)
        if problem is not None:
            yield ("routes", i), problem


def engine_route_problem(route: str) -> str | None:
    """Why `route` cannot be a client route of an engine (see ENGINE_ROUTE, ADMIN_ROUTE_WORDS), or None."""
    if not ENGINE_ROUTE.fullmatch(route):
        return (f"{route[:100]!r} is not a client route: expected a path under /v1/ of plain segments "
                "(letters, digits, . _ -), such as /v1/score")
    segments = route.lower().split("/")[2:]
    if segments[0] == "models":
        return f"{route!r} is the router's own (GET /v1/models lists the catalog)"
    for word in ADMIN_ROUTE_WORDS:
        if any(word in seg for seg in segments):
            return (f"{route!r} looks like an engine-admin route ({word!r}): those change the engine for "
                    "every client, and clients never reach them")
    return None
