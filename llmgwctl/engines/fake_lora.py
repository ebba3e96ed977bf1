"""The fake engine's LoRA adapters, as vLLM serves them: loaded at run time, a few at once on the "GPU".

`--max-loras N` turns it on, as --enable-lora --max-loras N does on vLLM.
Adapters are loaded and unloaded through vLLM's routes (`load`, `unload`:
the body `{lora_name, lora_path}`, its answers and error texts), listed in
/v1/models with their `parent`, and answered under their own name, so each
adapter's reply differs from the base's and from every other's.

`max_loras` is the slots a batch draws adapters from: a request for an
adapter in a slot is a hit; one for another takes the least recently used
slot (a miss), costing `--lora-swap-time` seconds, as vLLM swapping an
adapter's weights from host memory onto the GPU does. `--max-adapters`
bounds how many may be loaded at all (vLLM's host-memory cache evicts
instead; the fake refuses, so a test can see a load fail with the engine's
reason). What /metrics shows: `vllm:lora_requests_info` (running and
waiting adapters, the slot count) and the fake's own hit and miss counters.
"""
from __future__ import annotations

import asyncio
import os
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AdapterError(Exception):
    """A load or unload the engine refuses: `status` is its HTTP status, the message vLLM's text."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class FakeAdapters:
    def __init__(self, slots: int, max_adapters: int, swap_time: float):
        self.slots = slots
        self.max_adapters = max_adapters
        self.swap_time = swap_time
        self.loaded: dict[str, str] = {}                   # name -> path, in load order
        self._active: OrderedDict[str, None] = OrderedDict()   # the slots, least recently used first
        self.running: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()
        self.hits = 0
        self.misses = 0
        self._swap = asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    def load(self, name: object, path: object) -> str:
        if not self.enabled:
            raise AdapterError(400, "LoRA is not enabled (start the engine with --max-loras)")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise AdapterError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.loaded:
            raise AdapterError(400, f"The lora adapter '{name}' has already been loaded.")
        if path.startswith("/") and not os.path.isdir(path):
            # vLLM's words when the path holds no adapter.
            raise AdapterError(400, f"Loading lora {name} failed: No adapter found for {path}")
        if self.max_adapters and len(self.loaded) >= self.max_adapters:
            raise AdapterError(400, f"Loading lora {name} failed: this engine holds at most "
                                    f"{self.max_adapters} adapters (--max-adapters)")
        self.loaded[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: object) -> str:
        if not isinstance(name, str) or name not in self.loaded:
            raise AdapterError(404, f"The lora adapter '{name}' cannot be found.")
        del self.loaded[name]
        self._active.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    @asynccontextmanager
    async def using(self, name: str) -> AsyncIterator[None]:
        """A request for adapter `name` holds a slot for it while it runs (a swap first, on a miss)."""
        self.waiting[name] += 1
        try:
            if name in self._active:
                self.hits += 1
                self._active.move_to_end(name)
            else:
                self.misses += 1
                async with self._swap:     # one swap at a time: the copy to the device is the bottleneck
                    if self.swap_time > 0:
                        await asyncio.sleep(self.swap_time)
                    self._active[name] = None
                    while len(self._active) > self.slots:
                        self._active.popitem(last=False)
        finally:
            self._drop(self.waiting, name)
        self.running[name] += 1
        try:
            yield
        finally:
            self._drop(self.running, name)

    @staticmethod
    def _drop(counter: Counter[str], name: str) -> None:
        counter[name] -= 1
        if counter[name] <= 0:
            del counter[name]
