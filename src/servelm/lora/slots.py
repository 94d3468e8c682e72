"""Which adapter each of the model's `max_loras` slots holds: the runner's side of LoRA.

Adapters live in host memory (registry.py: --lora-modules and run-time loads); a step's
adapters are copied into slots as it needs them, the least recently used slot giving way. The
scheduler admits no more distinct adapters than there are slots (scheduler.py), so a step's
adapters always fit; a copy is the adapter's matrices once per layer (a rank-16 adapter of the
default model: ~30 MB of float32, a few milliseconds), paid only when a slot changes hands.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from servelm.lora.layers import NO_ADAPTER, LoRAModel
from servelm.lora.registry import AdapterRegistry


class LoRASlots:
    def __init__(self, model: LoRAModel, registry: AdapterRegistry, max_loras: int) -> None:
        self.model = model
        self.registry = registry
        self.max_loras = max_loras
        self._resident: OrderedDict[str, int] = OrderedDict()  # adapter name -> slot, least recent first
        self.loads = 0  # adapters copied into a slot so far (a slot changing hands)

    def slots_for(self, names: Sequence[str | None]) -> list[int]:
        """Each request's slot (NO_ADAPTER for the base model), loading the adapters not resident into
        the slots least recently used by adapters outside `names`."""
        wanted = list(dict.fromkeys(name for name in names if name is not None))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step mixes {len(wanted)} adapters, over --max-loras {self.max_loras}")
        for name in wanted:
            if name in self._resident:
                self._resident.move_to_end(name)
        for name in wanted:
            if name not in self._resident:
                self._resident[name] = self._free_slot(wanted)
                self.model.set_slot(self._resident[name], self.registry.get(name))
                self.loads += 1
        return [NO_ADAPTER if name is None else self._resident[name] for name in names]

    def forget(self, names: list[str]) -> None:
        """These adapters' slot copies are stale (unloaded, or loaded again under the name): free them."""
        for name in names:
            self._resident.pop(name, None)

    def _free_slot(self, keep: list[str]) -> int:
        used = set(self._resident.values())
        free = next((slot for slot in range(self.max_loras) if slot not in used), None)
        if free is not None:
            return free
        victim = next(name for name in self._resident if name not in keep)  # least recently used first
        return self._resident.pop(victim)
