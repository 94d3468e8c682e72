"""The adapters an engine serves, and which of them are in host memory: the core's side of LoRA.

    served    name -> LoRAModule      what a request's `model` may name (--lora-modules, run-time loads)
    host      name -> LoRAAdapter     weights read and checked, at most --max-cpu-loras, least recent out
    reading   name -> Future          a read in the background thread (a load, or a re-read after eviction)
    draining  names                   unloaded while requests still used them: kept until they finish

A request whose adapter is served but not in host memory waits while the background thread reads
it (`ready` starts the read; the scheduler admits the request once it is in); the step loop never
reads an adapter file itself. An adapter a running request uses is never evicted (the runner copies
it into a slot from here), so at most max_loras of them are pinned and --max-cpu-loras >= max_loras
always leaves room. `settle()`, called by the core between steps, brings finished reads in, evicts,
and drops what finished draining; the names it returns are the ones whose slot copies are stale.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from servelm.config import LoRAModule
from servelm.lora.adapter import LoRAAdapter, LoRAAdapterError

logger = logging.getLogger(__name__)

AdapterReader = Callable[[LoRAModule], LoRAAdapter]  # reads and checks one adapter (lora/adapter.py)


@dataclass
class LoadCall:
    """A run-time load: its module and the read that answers it."""

    module: LoRAModule
    read: Future[LoRAAdapter]


@dataclass
class AdapterRegistry:
    read_adapter: AdapterReader
    max_cpu_loras: int | None = None  # None: every served adapter stays in host memory
    served: dict[str, LoRAModule] = field(default_factory=dict)
    host: OrderedDict[str, LoRAAdapter] = field(default_factory=OrderedDict)  # least recently used first
    draining: dict[str, LoRAModule] = field(default_factory=dict)
    _reading: dict[str, tuple[LoRAModule, Future[LoRAAdapter]]] = field(default_factory=dict)
    _executor: ThreadPoolExecutor | None = None
    reads: int = 0  # adapter files read so far (start-up, loads, re-reads after eviction)
    failed_reads: dict[str, str] = field(default_factory=dict)

    @classmethod
    def at_start(cls, modules: Iterable[LoRAModule], read_adapter: AdapterReader,
                 max_cpu_loras: int | None) -> AdapterRegistry:  # fmt: skip
        """Every --lora-modules adapter read and checked now (a bad one stops the start-up, naming
        why); the first max_cpu_loras of them stay in host memory."""
        registry = cls(read_adapter, max_cpu_loras)
        for module in modules:
            adapter = registry._read(module)
            registry.served[module.name] = module
            registry._keep(adapter, pinned=set())
        return registry

    # -- the API's requests (through the core) -------------------------------------------

    def start_load(self, module: LoRAModule) -> LoadCall:
        """Begin reading a run-time adapter in the background; LoRAAdapterError now for a name
        already served (or still draining: its requests run on)."""
        if module.name in self.served or module.name in self.draining:
            raise LoRAAdapterError(f"a LoRA adapter named {module.name!r} is already loaded: unload it first")
        return LoadCall(module, self._executor_or_new().submit(self._read, module))

    def finish_load(self, call: LoadCall, running: set[str]) -> None:
        """A run-time load's read is done: serve it (its read's error, if any, is raised). What it
        evicts from host memory is never an adapter of a running request (`running`)."""
        adapter = call.read.result()
        if call.module.name in self.served:
            raise LoRAAdapterError(f"a LoRA adapter named {call.module.name!r} was loaded meanwhile")
        self.served[call.module.name] = call.module
        self._keep(adapter, pinned=running)

    def unload(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not served); its weights stay while requests use it."""
        self.draining[name] = self.served.pop(name)

    # -- the scheduler's and the runner's questions --------------------------------------

    def is_served(self, name: str) -> bool:
        return name in self.served

    def ready(self, name: str) -> bool:
        """Whether `name`'s weights are in host memory; if not, its read is started (or goes on)."""
        if name in self.host:
            return True
        if name not in self._reading:
            module = self._module_of(name)
            if module is None:
                return False  # not served (the core refuses such requests before they get here)
            self._reading[name] = (module, self._executor_or_new().submit(self._read, module))
        return False

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:
            raise KeyError(f"LoRA adapter {name!r} is not in host memory (served: {sorted(self.served)})")
        self.host.move_to_end(name)
        return adapter

    def needs_settling(self) -> bool:
        """Whether settle() has anything to do: reads to bring in, unloaded adapters to drop, or
        failed re-reads to report (most steps: none of them)."""
        return bool(self._reading or self.draining or self.failed_reads)

    def reads_in_flight(self) -> list[Future[LoRAAdapter]]:
        return [read for _, read in self._reading.values()]

    # -- between steps -------------------------------------------------------------------

    def settle(self, running: set[str], in_use: set[str]) -> list[str]:
        """Bring finished background reads in, evict the least recently used adapters over
        max_cpu_loras (never one in `running`), drop draining adapters no request uses (`in_use`).
        Returns the names whose weights left host memory for good or changed (their slots are stale)."""
        stale: list[str] = []
        for name, (module, read) in list(self._reading.items()):
            if not read.done():
                continue
            del self._reading[name]
            try:
                adapter = read.result()
            except LoRAAdapterError as exc:
                # Its files changed since it was loaded and checked: its requests fail (failed_reads).
                logger.error("LoRA adapter %r could not be read again: %s", name, exc)
                self.failed_reads[name] = str(exc)
                continue
            if self._module_of(name) is module:  # not unloaded and loaded again from elsewhere meanwhile
                self._keep(adapter, pinned=running)
        for name in sorted(set(self.draining) - in_use):
            del self.draining[name]
            self.host.pop(name, None)
            stale.append(name)
        return stale

    def take_failed_reads(self) -> dict[str, str]:
        """Adapters whose re-read failed since the last call, with why: their waiting requests fail."""
        failed, self.failed_reads = self.failed_reads, {}
        return failed

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _module_of(self, name: str) -> LoRAModule | None:
        return self.served.get(name) or self.draining.get(name)

    def _read(self, module: LoRAModule) -> LoRAAdapter:
        self.reads += 1
        return self.read_adapter(module)

    def _keep(self, adapter: LoRAAdapter, pinned: set[str]) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        if self.max_cpu_loras is None:
            return
        for name in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if name != adapter.name and name not in pinned and name not in self.draining:
                del self.host[name]  # served still: read again when a request needs it

    def _executor_or_new(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
        return self._executor
