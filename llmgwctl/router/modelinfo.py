"""What a model's engines say about it: its context length, asked once of each endpoint as it joins.

Clients (LiteLLM, IDE plugins) read a model's context length off
`/v1/models`, and only the engine knows it: vLLM and SGLang put
`max_model_len` on their own `/v1/models` card, llama.cpp's server puts
`n_ctx` in `/props` (`default_generation_settings.n_ctx`; its `/v1/models`
only has the length the model was trained at, not the one it serves).
`ModelInfo` asks each endpoint once, when the router is told it is ready
(`sync`, run soon after each change of the endpoint list): its `/v1/models`
card first, `/props` when the card has no length. What it learns it keeps
for as long as the endpoint is listed.

A model's length is the smallest of its listed endpoints' (a request may
be sent to any of them, so only the smallest is safe); with none listed
(scaled to zero, say), the last length one of them said, so the list does
not lose it while the model sleeps; None until an engine said one.

An engine is a peer the router does not trust, and this is off the hot
path: at most `max_bytes` of an answer is read (a larger one is not read
at all), a redirect is never followed, each ask is bounded by `timeout`,
and the answer must hold a whole number in a sane range (`MAX_LENGTH`).
An engine that does not answer (still binding its port, a blip) is asked
again with backoff, `tries` times at most; one that answers without a
length is not asked again.

It must not know about HTTP requests of clients, the catalog or the balancer's pick.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp

from ..aio import cancel_and_wait
from ..backoff import Backoff
from ..contracts import Endpoint
from .balancer import EndpointState
from .poller import InterimBound, read_capped

__all__ = ["MAX_LENGTH", "ModelInfo", "context_from_card", "context_from_props"]

log = logging.getLogger("llmgw.router.modelinfo")

# 2**31 - 1 tokens: past any model's context (the longest are around ten
# million), so a larger number is an engine's garbage, not a length.
MAX_LENGTH = 2**31 - 1
# A vLLM /v1/models card is a few hundred bytes, and a list with many LoRA
# adapters some KiB: 256 KiB is far past a real one, and small to parse.
MAX_BYTES = 256 * 1024
# An engine that just turned ready answers within milliseconds; a few
# seconds cover a loaded machine without holding a task for long.
TIMEOUT = 5.0
# Three asks with backoff (1 s, 2 s ceilings) cover an engine that turned
# ready a moment before it answers /v1/models; past that it has no answer.
TRIES = 3
# Half a second: a joining endpoint is asked that much later at most, which
# no client notices, while a fleet's burst of pushes costs one pass.
COALESCE = 0.5


def _length(value: Any) -> int | None:
    """`value` when it is a whole number of tokens in 1..MAX_LENGTH, else None (bool is not a number here)."""
    if type(value) is int and 0 < value <= MAX_LENGTH:
        return value
    return None


def context_from_card(doc: Any, model: str) -> int | None:
    """The `max_model_len` of `model`'s card in a /v1/models answer (vLLM's, SGLang's); of its only card
    when none is named so; None when there is none."""
    if not isinstance(doc, dict):
        return None
    data = doc.get("data")
    if not isinstance(data, list):
        return None
    cards = [c for c in data if isinstance(c, dict)]
    named = [c for c in cards if c.get("id") == model]
    card = named[0] if named else cards[0] if len(cards) == 1 else None
    return _length(card.get("max_model_len")) if card is not None else None


def context_from_props(doc: Any) -> int | None:
    """The context a llama.cpp server runs with, from its /props: `default_generation_settings.n_ctx`
    (older servers: `n_ctx` at the top); None when neither is there."""
    if not isinstance(doc, dict):
        return None
    settings = doc.get("default_generation_settings")
    found = _length(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return found if found is not None else _length(doc.get("n_ctx"))


class _NoAnswer(Exception):
    """The engine did not answer the ask (refused, reset, timed out): worth asking again."""


class ModelInfo:
    """Each listed endpoint's context length, asked once as it joins; `context_length(model)` reads them."""

    def __init__(self, *, max_bytes: int = MAX_BYTES, timeout: float = TIMEOUT, tries: int = TRIES,
                 backoff: Backoff | None = None):
        self.max_bytes = max_bytes
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._tries = tries
        self._backoff = backoff     # None: a fresh one per endpoint (1 s doubling, full jitter)
        self._session: aiohttp.ClientSession | None = None
        self._asking: dict[str, asyncio.Task[None]] = {}
        self._listed: dict[str, Endpoint] = {}
        # model -> {replica id: what its engine said}: a model's length is a min over its own replicas only.
        self._lengths: dict[str, dict[str, int]] = {}
        self._last: dict[str, int] = {}          # model -> its length when it last had endpoints that said one
        # Bumped whenever what `context_length` answers may have changed, so /v1/models can cache.
        self.generation = 0
        self._changed = asyncio.Event()

    def start(self, session: aiohttp.ClientSession) -> None:
        """Ask with `session` from now on (the poller's: its caps on headers and interim answers)."""
        self._session = session

    def changed(self) -> None:
        """The endpoint list changed: `run` syncs with it soon. Cheap, so every push may call it."""
        self._changed.set()

    async def run(self, states: Callable[[], Iterable[EndpointState]]) -> None:
        """Sync with `states()` after each change; a burst of changes costs one pass over the list."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            self.sync(states())
            # A push costs the router the endpoints that changed, not the whole
            # list (surface.change_endpoints); a pass here walks the whole list,
            # so at most one pass per COALESCE keeps a fleet's pushes cheap.
            await asyncio.sleep(COALESCE)

    def sync(self, states: Iterable[EndpointState]) -> None:
        """The endpoint list is now `states`: ask the endpoints not asked yet, forget those gone. Call on the loop."""
        listed = {st.replica_id: st.endpoint for st in states}
        for rid in [r for r in self._listed if r not in listed]:
            ep = self._listed.pop(rid)
            task = self._asking.pop(rid, None)
            if task is not None:
                task.cancel()
            said = self._lengths.get(ep.model)
            if said is not None and said.pop(rid, None) is not None:
                if said:
                    self._last[ep.model] = min(said.values())
                else:
                    del self._lengths[ep.model]     # _last keeps what it said while scaled to zero
                self.generation += 1
        session = self._session
        if session is None:
            return      # not started: the Router syncs once it has, and every endpoint listed then is asked
        for rid, ep in listed.items():
            if rid not in self._listed:
                self._listed[rid] = ep
                self._asking[rid] = asyncio.get_running_loop().create_task(self._learn(ep, session))

    def retain(self, models: Iterable[str]) -> None:
        """Forget the last lengths of models not in `models` (the catalog's), so none is kept for good."""
        keep = set(models)
        for name in [m for m in self._last if m not in keep]:
            del self._last[name]
            self.generation += 1

    def context_length(self, model: str) -> int | None:
        """The context length a request for `model` can count on (see the module docstring), or None."""
        said = self._lengths.get(model)
        if said:
            return min(said.values())
        return self._last.get(model)

    def lengths(self) -> Mapping[str, int]:
        """{replica id: the context length its engine said}, for tests and status."""
        return {rid: n for said in self._lengths.values() for rid, n in said.items()}

    async def close(self) -> None:
        tasks = list(self._asking.values())
        self._asking.clear()
        for task in tasks:
            await cancel_and_wait(task)

    # -- asking one endpoint -----------------------------------------------------------------------

    async def _learn(self, ep: Endpoint, session: aiohttp.ClientSession) -> None:
        backoff = self._backoff or Backoff(initial=1.0, cap=4.0)
        try:
            for attempt in range(1, self._tries + 1):
                try:
                    found = await self.ask(ep, session)
                except _NoAnswer as exc:
                    if attempt == self._tries:
                        log.info("endpoint %s: no context length, its engine did not answer %d asks (last: %s)",
                                 ep.replica_id, self._tries, exc)
                        return
                    await asyncio.sleep(backoff.failure())
                    continue
                if found is not None and ep.replica_id in self._listed:
                    said = self._lengths.setdefault(ep.model, {})
                    said[ep.replica_id] = found
                    self._last[ep.model] = min(said.values())
                    self.generation += 1
                return
        finally:
            self._asking.pop(ep.replica_id, None)

    async def ask(self, ep: Endpoint, session: aiohttp.ClientSession) -> int | None:
        """The context length `ep`'s engine says it serves `ep.model` with: its /v1/models card, else its /props.

        None when it answered without one; `_NoAnswer` when it did not answer /v1/models at all.
        """
        card = await self._get(session, ep.url + "/v1/models")
        found = context_from_card(card, ep.model)
        if found is not None:
            return found
        try:
            return context_from_props(await self._get(session, ep.url + "/props"))
        except _NoAnswer:
            return None

    async def _get(self, session: aiohttp.ClientSession, url: str) -> Any:
        """The JSON document at `url`, or None for any answer that is not a 200 with a small JSON body."""
        try:
            async with session.get(url, timeout=self._timeout, allow_redirects=False) as resp:
                if resp.status != 200:
                    return None
                data = await read_capped(resp, self.max_bytes)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _NoAnswer(type(exc).__name__) from None
        except (InterimBound, ValueError):
            return None     # it answered, if badly (endless 1xx, a header past the caps)
        if data is None:
            return None
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            return None
