"""LoRA adapters on this node's engines: load what each replica's spec places there, unload the rest.

Owns, per replica, what its engine holds (learned once per engine process
from its /v1/models, so an adopted engine's adapters are known, then kept
by this module's own calls), each adapter's failures and back-off, and the
statuses the report carries. Level-triggered like the agent's pass: `sync()`
is called every pass with the replicas, starts one background task per
ready engine whose adapters differ from its spec's, and returns at once --
a load can take seconds (a hub download), and a pass must not wait on it.
A task's outcome wakes the agent (`on_change`), so it is reported at once.

The calls are vLLM's runtime routes (engines/lora.py), which only the agent
reaches: the router's route table does not carry them. An engine that loads
its adapters only at launch (llama.cpp) is only read: once per engine
process, its listing (`GET /lora-adapters`) says which number is which
adapter, which the report carries (`AdapterStatus.engine_id`) for the router
to name in each request; an adapter it does not list is failed, and a
listing that fails is read again with the same back-off as a load. An
engine's answers are bounded: a reason is cut to a line, a /v1/models page
(or a listing) to MAX_MODELS_BYTES.
It must not know how replicas are started, nor where their specs come from.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from ..backoff import Backoff
from ..contracts import AdapterSpec, AdapterStatus
from ..contracts.adapters import FAILED, LOADED, LOADING, MAX_ADAPTER_REASON, UNLOADING
from ..engines.errors import LaunchError
from ..engines.gguf import resolve_gguf
from ..engines.lora import LAUNCH_LISTING, RUNTIME_API, busy_adapters, numbered, resolve_source
from .replica import READY, Replica

log = logging.getLogger("llmgw.agent.adapters")

# A load reads the adapter's weights (from disk, or the hub) and copies them
# to host memory: seconds for a rank-16 adapter of a 7B model, a minute or
# two for a big one fetched from the hub. Past 5 minutes it is stuck.
LOAD_TIMEOUT = 300.0
# /v1/models, where the engine lists what it holds: a few hundred bytes an
# adapter; 4 MiB is thousands of them, past which the page is not an answer.
# A /metrics page is bounded the same way (the router's poller reads it too).
MAX_MODELS_BYTES = 4 << 20
# An adapter leaving a replica is unloaded once the engine's
# vllm:lora_requests_info shows no request running or waiting on it (the
# router stopped sending it new ones when it left the catalog or the
# replica), or after this long: the router's default drain grace, the bound
# a replica's own requests get before its engine is stopped.
UNLOAD_GRACE = 30.0


def retry_schedule(clock: Callable[[], float]) -> Backoff:
    # 2 s first: a load that failed because the engine was busy, or a path
    # being synced, heals in seconds. 5 min cap: a wrong path or too big a
    # rank fails the same way until the catalog changes (which starts over),
    # so retrying it costs the engine one failed read every five minutes.
    return Backoff(initial=2.0, cap=300.0, jitter=0.0, clock=clock)


@dataclass
class _Engine:
    """One engine process's adapters: what it holds (name -> source), and the failures of those it does not."""

    pid: int
    url: str
    listed: bool = False
    held: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)       # name -> the engine's number (launch-time engines)
    failed: dict[str, tuple[str, float, Backoff]] = field(default_factory=dict)   # name -> (reason, retry at, schedule)
    leaving: dict[str, float] = field(default_factory=dict)     # name -> since when it is to be unloaded
    task: asyncio.Task[None] | None = None


class AdapterKeeper:
    def __init__(self, session: aiohttp.ClientSession, *, on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, timeout: float = LOAD_TIMEOUT):
        self._session = session
        self._on_change = on_change
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._engines: dict[str, _Engine] = {}

    def sync(self, replicas: Iterable[Replica], url_of: Callable[[int], str]) -> None:
        """Start bringing each ready engine's adapters to its spec's; forget engines that are gone."""
        seen: set[str] = set()
        now = self._clock()
        for r in replicas:
            rid = r.spec.id
            seen.add(rid)
            listing = LAUNCH_LISTING.get(r.spec.engine) if r.spec.adapters else None
            if listing is None and (r.spec.engine not in RUNTIME_API or not r.spec.lora_slots):
                continue
            e = self._engines.get(rid)
            if r.state != READY or r.pid is None or r.port is None:
                if e is not None and e.pid != r.pid:
                    # A new engine process holds none of the old one's adapters.
                    self._forget(rid)
                continue
            if e is None or e.pid != r.pid:
                self._forget(rid)
                e = self._engines[rid] = _Engine(pid=r.pid, url=url_of(r.port))
            if e.task is not None and not e.task.done():
                continue
            if listing is not None:
                if not e.listed and all(f[1] <= now for f in e.failed.values()):
                    e.task = asyncio.create_task(self._number(e, rid, listing, r.spec.adapters))
            elif self._has_work(e, r.spec.adapters, now):
                e.task = asyncio.create_task(self._converge(e, rid, r.spec.adapters))
        for rid in [rid for rid in self._engines if rid not in seen]:
            self._forget(rid)

    def statuses(self, r: Replica) -> tuple[AdapterStatus, ...]:
        """What the report says of `r`'s adapters: every one its spec places there, then those leaving."""
        e = self._engines.get(r.spec.id)
        if e is not None and e.pid != r.pid:
            e = None
        out = []
        for a in r.spec.adapters:
            if e is not None and e.held.get(a.name) == a.source:
                out.append(AdapterStatus(a.name, LOADED, engine_id=e.ids.get(a.name)))
            elif e is not None and a.name in e.failed:
                out.append(AdapterStatus(a.name, FAILED, e.failed[a.name][0]))
            else:
                out.append(AdapterStatus(a.name, LOADING))
        wanted = {a.name for a in r.spec.adapters}
        if e is not None:
            out.extend(AdapterStatus(name, UNLOADING) for name in e.held if name not in wanted)
        return tuple(out)

    async def close(self) -> None:
        tasks = [e.task for e in self._engines.values() if e.task is not None and not e.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one engine's convergence ---------------------------------------------

    def _has_work(self, e: _Engine, wanted: tuple[AdapterSpec, ...], now: float) -> bool:
        if not e.listed:
            return True
        names = {a.name for a in wanted}
        if any(name not in names for name in e.held):
            return True
        return any(e.held.get(a.name) != a.source and (a.name not in e.failed or e.failed[a.name][1] <= now)
                   for a in wanted)

    async def _converge(self, e: _Engine, rid: str, wanted: tuple[AdapterSpec, ...]) -> None:
        changed = False
        try:
            names = {a.name: a.source for a in wanted}
            if not e.listed:
                e.held = {name: names.get(name, "") for name in await self._listed(e)}
                e.listed = True
                changed = True
            # Unloads first: they free the engine's memory for the loads. Each
            # waits for the adapter's requests in flight (bounded by UNLOAD_GRACE).
            now = self._clock()
            going = [name for name, source in e.held.items() if names.get(name) != source]
            for name in [n for n in e.leaving if n not in going]:
                del e.leaving[name]
            busy = await self._busy(e) if going else frozenset()
            for name in going:
                since = e.leaving.setdefault(name, now)
                if name in busy and now - since < UNLOAD_GRACE:
                    continue
                why = await self._call(e, "/v1/unload_lora_adapter", {"lora_name": name})
                if why and "cannot be found" not in why and "not found" not in why.lower():
                    log.warning("replica %s: unloading adapter %s: %s", rid, name, why)
                    continue
                del e.held[name]
                e.leaving.pop(name, None)
                changed = True
                log.info("replica %s: adapter %s unloaded", rid, name)
            now = self._clock()
            for a in wanted:
                if e.held.get(a.name) == a.source:
                    continue
                failed = e.failed.get(a.name)
                if failed is not None and failed[1] > now:
                    continue
                why = await self._load(e, a)
                changed = True
                if not why:
                    e.held[a.name] = a.source
                    e.failed.pop(a.name, None)
                    log.info("replica %s: adapter %s loaded from %s", rid, a.name, a.source)
                else:
                    schedule = failed[2] if failed is not None else retry_schedule(self._clock)
                    delay = schedule.failure()
                    e.failed[a.name] = (why[:MAX_ADAPTER_REASON], self._clock() + delay, schedule)
                    log.warning("replica %s: adapter %s did not load (retrying in %.0f s): %s", rid, a.name, delay, why)
            for name in [n for n in e.failed if n not in names]:
                del e.failed[name]
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("replica %s: adapter sync failed", rid)
        finally:
            if changed:
                self._on_change()

    async def _number(self, e: _Engine, rid: str, route: str, placed: tuple[AdapterSpec, ...]) -> None:
        """Which number a launch-time engine gave each adapter placed on it, from its listing; failures with back-off."""
        try:
            async with self._session.get(e.url + route, timeout=self._timeout) as resp:
                body = await resp.content.read(MAX_MODELS_BYTES + 1)
                if resp.status != 200 or len(body) > MAX_MODELS_BYTES:
                    raise ValueError(f"{route} answered {resp.status} ({len(body)} bytes)")
            paths = await asyncio.to_thread(lambda: [(a.name, str(resolve_gguf(a.source))) for a in placed])
            ids = numbered(json.loads(body), paths)
        except asyncio.CancelledError:
            raise
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError, LaunchError) as exc:
            why = f"reading the engine's {route}: {type(exc).__name__}: {exc}"[:MAX_ADAPTER_REASON]
            for a in placed:
                schedule = e.failed[a.name][2] if a.name in e.failed else retry_schedule(self._clock)
                e.failed[a.name] = (why, self._clock() + schedule.failure(), schedule)
            log.warning("replica %s: %s", rid, why)
        else:
            e.listed, e.ids = True, ids
            e.held = {a.name: a.source for a in placed if a.name in ids}
            e.failed = {a.name: (f"the engine does not list it at {route}", 0.0, retry_schedule(self._clock))
                        for a in placed if a.name not in ids}
            log.info("replica %s: adapters by engine number: %s", rid, ids)
        self._on_change()

    async def _load(self, e: _Engine, a: AdapterSpec) -> str:
        """"" when the engine holds `a` now, else why not (ours or the engine's words)."""
        try:
            path = await asyncio.to_thread(resolve_source, a.source)
        except LaunchError as exc:
            return str(exc)
        why = await self._call(e, "/v1/load_lora_adapter", {"lora_name": a.name, "lora_path": path})
        if why and "already been loaded" in why:
            return ""       # loaded before this agent knew (a call that timed out, then succeeded)
        return why

    async def _busy(self, e: _Engine) -> frozenset[str]:
        """The adapters with requests on the engine now; all of its held ones when its page does not say."""
        try:
            async with self._session.get(e.url + "/metrics", timeout=self._timeout) as resp:
                page = await resp.content.read(MAX_MODELS_BYTES + 1)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
            return frozenset(e.held)
        found = busy_adapters(page.decode("utf-8", "replace")) if len(page) <= MAX_MODELS_BYTES else None
        # An engine whose page says nothing of adapters is waited for the whole grace: nothing says it is idle.
        return frozenset(e.held) if found is None else found

    async def _listed(self, e: _Engine) -> list[str]:
        """The adapters the engine serves now: its /v1/models cards with a parent.

        Their source is not on the page (`root` is the resolved path): the
        caller assumes the spec's, which is what loaded it unless the catalog
        changed the source while this agent was down.
        """
        async with self._session.get(e.url + "/v1/models", timeout=self._timeout) as resp:
            body = await resp.content.read(MAX_MODELS_BYTES + 1)
            if resp.status != 200 or len(body) > MAX_MODELS_BYTES:
                raise RuntimeError(f"/v1/models answered {resp.status} ({len(body)} bytes)")
        cards = json.loads(body).get("data") or []
        return [str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent") and c.get("id")]

    async def _call(self, e: _Engine, path: str, body: dict[str, str]) -> str:
        try:
            async with self._session.post(e.url + path, json=body, timeout=self._timeout) as resp:
                if resp.status == 200:
                    return ""
                text = (await resp.content.read(MAX_ADAPTER_REASON * 4)).decode("utf-8", "replace")
        except asyncio.TimeoutError:
            return f"the engine did not answer {path} within {self._timeout.total:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return f"{path} failed: {type(exc).__name__}: {exc}"
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text
        return f"engine answered {resp.status}: {' '.join(str(message).split())}"[:MAX_ADAPTER_REASON]

    def _forget(self, rid: str) -> None:
        e = self._engines.pop(rid, None)
        if e is not None and e.task is not None and not e.task.done():
            e.task.cancel()
