"""Running a router as its own process: static files, or following a controller.

Owns wiring a `Router` to its source of endpoints and catalog, serving it, and
stopping cleanly on SIGTERM/SIGINT. The CLI (`llmgwctl router`) only parses
options and calls `run`.

- Static (`endpoints_file` + `catalogs_dir`, a `static.StaticSource`): the catalog directory is followed
  by the catalog watcher (a valid edit swaps in, an invalid one is logged and
  ignored); the endpoint file is followed (`static.EndpointFileFollower`, an
  `fsutil.FollowedFile`) and re-read on every edit, after every catalog swap
  (its defaults come from the catalog) and on SIGHUP. An edit that does not
  load, or anything at the path that is not a usable file, is logged with
  every problem and the endpoints in force stay. Nothing wakes cold models: a model without
  endpoints answers 503 at once.
- Controller (`controller`): the first watch answer is awaited before listening,
  so the router never answers "no such model" just because it has not heard
  the catalog yet; after that it follows the watch and keeps serving its last
  list while the controller is away.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

import aiohttp

from ..aio import cancel_and_wait, sleep_unless
from .config import DEFAULTS, RouterConfig
from .server import Router, start
from .static import StaticSource
from .watch import ControllerWaker, ControllerWatch, RequestOutbox, UsageReporter, WatchError

log = logging.getLogger("llmgw.router")


async def run(host: str, port: int, *, endpoints_file: str | None = None, catalogs_dir: str | None = None,
              controller: str | None = None, token: str | None = None, config: RouterConfig = DEFAULTS,
              on_listening: Callable[[int], None] | None = None, stop: asyncio.Event | None = None,
              api_keys: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`). CatalogError / EndpointFileError / KeyFileError if the files are bad."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[Any]] = []
    session = aiohttp.ClientSession()     # control-plane calls only; engine traffic has its own pool
    runner = None
    try:
        if controller is not None:
            router = Router(waker=ControllerWaker(controller, session, token=token), config=config)
            watch = ControllerWatch(router, controller, session, token=token)
            await _first_contact(watch, controller, stop)
            if stop.is_set():
                return
            tasks.append(loop.create_task(watch.run()))
            # Its requests go to the controller's request log with its usage (the console shows them).
            outbox = RequestOutbox()
            router.set_request_sink(outbox)
            tasks.append(loop.create_task(UsageReporter(router, watch, controller, session, token=token,
                                                        outbox=outbox).run()))
        else:
            assert endpoints_file is not None and catalogs_dir is not None
            router = _static(endpoints_file, catalogs_dir, config, tasks, stop)
        if api_keys is not None:
            from .auth import follow_keys
            tasks.append(follow_keys(router, api_keys, stop).task)     # before listening: never open for a moment
        runner, bound = await start(router, host, port)
        log.info("router listening on http://%s:%d", host, bound)
        if on_listening is not None:
            on_listening(bound)
        await stop.wait()
    finally:
        await cancel_and_wait(*tasks)
        if runner is not None:
            await runner.cleanup()
        await session.close()


async def _first_contact(watch: ControllerWatch, controller: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await watch.poll_once()
            return
        except WatchError as exc:
            delay = watch.backoff.failure()
            log.warning("waiting for the controller at %s before listening (retry in %.1f s): %s",
                        controller, delay, exc)
            await sleep_unless(delay, stop)


def _static(endpoints_file: str, catalogs_dir: str, config: RouterConfig, tasks: list[asyncio.Task[Any]], stop: asyncio.Event) -> Router:
    source = StaticSource(endpoints_file, catalogs_dir)
    router = Router(source.load_initial(), config=config)     # CatalogError: nothing to serve yet, the CLI reports it
    router.metrics.follow(source.catalogs.watcher_status)
    endpoints = source.start(router, stop, tasks)              # EndpointFileError likewise
    router.metrics.follow(endpoints.status)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, source.reread)
    return router
