"""Router API keys (optional, `llmgwctl router --api-keys FILE`): who may call, which models, how often.

The file (YAML), watched and reloaded like a catalog -- a valid edit is in force
within a moment, an invalid one is logged with every problem and the keys in
force stay as they were (`KeyFileWatcher` says what else may be at the path):

    keys:
      - name: team-search             # unique; shown in the access log, never the key
        sha256: 9f86d081884c7d65...   # hex SHA-256 of the key: printf %s "$KEY" | sha256sum
        models: ["qwen*", "default"]  # glob patterns over model names and aliases
        rpm: 600                      # requests per minute (a bucket of rpm, refilled rpm/60 a second)

Clients send `Authorization: Bearer <key>` (what every OpenAI SDK sends as its
api_key) or `x-api-key: <key>` (what the `anthropic` SDK and Claude Code send);
a request with an `Authorization` header is judged by it alone, so one
request cannot offer two keys and be let in by either. The checks, in order:

1. no key, or one not in the file -> 401, before the body is read;
2. over its rate -> 429 with Retry-After (seconds until the bucket holds one
   request again), before the body is read, so a key over its limit cannot
   make the router parse anything;
3. once the body names a model: a name that matches none of the key's patterns,
   and is not an alias of (or the model behind) a name that does, -> 403. The
   answer is the same whether the model exists or not, so a key cannot probe
   the catalog; only a permitted name can get the router's 404.

`GET /v1/models` lists only what the key may use, and with keys on `/metrics`
needs a key too (any key: give Prometheus one with `models: []`); `/healthz`
stays open for probes.

Decisions: keys are stored as SHA-256, not bcrypt or argon2, because they are
random tokens an operator generates (`openssl rand -hex 32`), not passwords: a
fast hash of a 256-bit secret cannot be brute-forced, and a slow hash would
cost milliseconds of CPU on every request. The lookup is a dict keyed by the
digest of what the client sent, so timing tells a client nothing about the
stored keys (it cannot steer the digest). Buckets are kept per key name across
reloads, so editing the file neither resets nor forgives anyone's rate.

It must not know HTTP beyond the header value and the error responses, nor
the balancer: the server calls `lookup`, `Limiter.take` and `allows`.
"""
from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..fsutil import FollowedFile
from . import errors
from .yamlfile import MAX_BYTES, Layout, entries, load_yaml, parse_yaml

log = logging.getLogger("llmgw.router.keys")

_HEX64 = re.compile(r"[0-9a-f]{64}")
_LAYOUT = Layout(key="keys", fields=frozenset({"name", "sha256", "models", "rpm"}), required=("name", "sha256", "models", "rpm"),
                 example="keys: [{name: team-a, sha256: <64 hex>, models: ['*'], rpm: 600}]",
                 entry="expected a mapping with name, sha256, models and rpm",
                 hint=lambda unknown: (" (store the key's SHA-256 in 'sha256', never the key)"
                                       if unknown in ("key", "token", "secret") else ""))


class KeyFileError(errors.RouterError):
    """The API key file cannot be used; the message lists every problem, one per line."""


def hash_key(key: str) -> str:
    """What goes in the file's `sha256` field for `key`."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: str
    models: tuple[str, ...]
    rpm: int
    _pattern: Any = None            # the globs as one compiled regex

    def may_use(self, name: str) -> bool:
        return self._pattern is not None and self._pattern.match(name) is not None


class ApiKeys:
    """An immutable set of keys, built only by `parse_keys` / `load_keys`."""

    __slots__ = ("_by_digest", "source")

    def __init__(self, keys: Iterable[ApiKey], source: str = "<keys>"):
        self._by_digest = {k.digest: k for k in keys}
        self.source = source

    def __len__(self) -> int:
        return len(self._by_digest)

    def names(self) -> list[str]:
        return sorted(k.name for k in self._by_digest.values())

    def lookup(self, authorization: str | None, api_key: str | None = None) -> ApiKey | None:
        """The key behind an `Authorization: Bearer ...` header value, else behind an `x-api-key` one; or None.

        With an Authorization header the x-api-key is not looked at: it is
        the header OpenAI clients send, and a key is one credential.
        """
        if authorization is not None:
            # The scheme is case-insensitive (RFC 9110 11.1): "bearer KEY" is "Bearer KEY".
            if authorization[:7].lower() != "bearer ":
                return None
            secret = authorization[7:].strip()
        elif api_key is not None:
            secret = api_key.strip()
        else:
            return None
        if not secret:
            return None
        return self._by_digest.get(hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest())


def allows(key: ApiKey, requested: str, model: Any | None) -> bool:
    """May `key` send a request naming `requested`, which resolved to `model` (a catalog Model or None)?"""
    if key.may_use(requested):
        return True
    if model is None:
        return False
    # A key allowed "qwen*" may also use qwen's canonical name or any other alias
    # of it: they are the same model and the same GPUs.
    return key.may_use(model.name) or any(key.may_use(a) for a in model.aliases)


def parse_keys(doc: Any, source: str = "<keys>") -> ApiKeys:
    problems: list[str] = []
    out: list[ApiKey] = []
    names: dict[str, int] = {}
    digests: dict[str, int] = {}
    for i, where, raw in entries(doc, _LAYOUT, source, KeyFileError, problems):
        name, digest, models, rpm = raw["name"], raw["sha256"], raw["models"], raw["rpm"]
        if not isinstance(name, str) or not name:
            problems.append(f"{where}.name: must be a non-empty string")
            continue
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest.lower()):
            # YAML reads a digest of digits only as a number: say so rather than "not hex".
            quote = "; quote it so YAML reads it as text" if isinstance(digest, (int, float)) else ""
            problems.append(f"{where}.sha256: must be 64 hex digits, the SHA-256 of the key "
                            f"(printf %s \"$KEY\" | sha256sum){quote}")
            continue
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            problems.append(f"{where}.models: must be a list of model names or glob patterns, e.g. ['qwen*']")
            continue
        if isinstance(rpm, bool) or not isinstance(rpm, int) or rpm < 1:
            problems.append(f"{where}.rpm: must be a whole number of requests per minute, at least 1; got {rpm!r}")
            continue
        digest = digest.lower()
        if name in names:
            problems.append(f"{where}.name: {name!r} is already used by keys[{names[name]}]")
            continue
        if digest in digests:
            problems.append(f"{where}.sha256: the same key is already keys[{digests[digest]}]")
            continue
        names[name], digests[digest] = i, i
        pattern = re.compile("|".join(f"(?:{fnmatch.translate(m)})" for m in models)) if models else None
        out.append(ApiKey(name=name, digest=digest, models=tuple(models), rpm=rpm, _pattern=pattern))
    if problems:
        raise KeyFileError("\n".join(problems))
    return ApiKeys(out, source)


def load_keys(path: str | os.PathLike[str]) -> ApiKeys:
    """The keys in `path`; KeyFileError if it is not a usable key file (see `yamlfile` for the bounds). Blocking."""
    return parse_keys(load_yaml(path, KeyFileError, "API key file"), os.fspath(path))


class Limiter:
    """A token bucket per key name: holds up to `rpm` requests, refilled at rpm/60 a second.

    A full bucket lets a client that was quiet send a minute's worth at once,
    which is what "N requests per minute" promises; after that it gets one
    every 60/rpm seconds. Mutated only on the event loop.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._buckets: dict[str, list[float]] = {}      # name -> [tokens, at]

    def take(self, key: ApiKey) -> float:
        """0.0 if the request may go now (and count it), else seconds until it could."""
        now = self._clock()
        b = self._buckets.get(key.name)
        if b is None:
            b = self._buckets[key.name] = [float(key.rpm), now]
        tokens = min(float(key.rpm), b[0] + (now - b[1]) * key.rpm / 60.0)
        b[1] = now
        if tokens >= 1.0:
            b[0] = tokens - 1.0
            return 0.0
        b[0] = tokens
        return (1.0 - tokens) * 60.0 / key.rpm

    def retain(self, names: Iterable[str]) -> None:
        keep = set(names)
        for name in [n for n in self._buckets if n not in keep]:
            del self._buckets[name]


# -- the responses ------------------------------------------------------------------

def unauthorized() -> Any:
    return errors.response(401, "a valid API key is required: send it as 'Authorization: Bearer <key>' "
                           "(or 'x-api-key: <key>')",
                           "invalid_request_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden(name: str) -> Any:
    # Same words whether or not the model exists: a key must not learn the catalog.
    return errors.response(403, f"this API key may not use the model {errors.quote(name)}", "invalid_request_error",
                           "model_not_permitted")


def rate_limited(key: ApiKey, wait: float) -> Any:
    return errors.response(429, f"API key {key.name!r} is over its limit of {key.rpm} requests per minute; "
                           f"retry in {math.ceil(wait)} s", "rate_limit_error", "rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})


# -- following the file ---------------------------------------------------------------

class KeyFileWatcher(FollowedFile[ApiKeys]):
    """Follows the key file (`fsutil.FollowedFile`); `reload()` is one pass, for tests and SIGHUP.

    `apply(keys)` is called with every valid new set (on the event loop when
    run by `run`). Anything else at the path -- an invalid edit, a FIFO, a
    link to a device, a file past its cap, a file deleted or made unreadable
    -- is logged with why, counted, shown in status, and the keys in force
    stay as they were. Decided as the operator whose revocation must take
    would want it: a key is revoked by writing the file without it (or with
    `keys: []`), and that takes within seconds whatever was at the path
    before. Deleting the file revokes nothing: it is as often a deploy's
    rename dance or a remount caught half way, and refusing every client then
    would be an outage nobody asked for; opening the router would be worse.
    Status says the file is missing until it is back.
    """

    def __init__(self, path: str | os.PathLike[str], apply: Callable[[ApiKeys], None],
                 on_result: Callable[[str], None] = lambda result: None):
        source = os.path.abspath(os.fspath(path))

        def applied(keys: ApiKeys) -> None:
            apply(keys)
            log.info("API keys in force from %s: %d keys (%s)", source, len(keys), ", ".join(keys.names()),
                     extra={"event": "api-keys-reloaded"})

        super().__init__(source, name="api-keys", what="API key file", rejects=KeyFileError, max_bytes=MAX_BYTES,
                         parse=lambda data: parse_keys(parse_yaml(data, source, KeyFileError), source),
                         apply=applied, on_result=on_result, keeping="keeping the keys in force")


def follow_keys(router: Any, path: str | os.PathLike[str], stop: asyncio.Event) -> KeyFileWatcher:
    """Put the keys in `path` in force on `router` now, and follow the file until `stop` (the task: `.task`).

    KeyFileError if the file is unusable at start (call before the router
    listens, so it never serves a moment without its keys). Call on the loop.
    The start-up read is on the loop: nothing is served yet, and the reader
    never blocks on what is at the path (see `fsutil.read_regular`).
    """
    reloads = router.metrics.key_reloads
    watcher = KeyFileWatcher(path, router.set_api_keys, on_result=lambda result: reloads.labels(result).inc())
    watcher.load_initial()
    router.metrics.follow(watcher.status)
    watcher.start(stop)
    return watcher
