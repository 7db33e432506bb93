"""The engine's LoRA slots: which adapter each slot holds, the stacked slot buffers the graph reads, and who
holds a slot (see :mod:`llmc.runtime.lora.adapter` for the adapters and the policy)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.lora.adapter import LoraAdapter, LoraSpec, read_adapter


class LoraSlots:
    """The engine's adapter registry and slot buffers (see the module docstring). Not thread-safe: the engine
    calls it under its lock."""

    def __init__(self, spec: LoraSpec, dtype: str = "float32") -> None:
        self.spec = spec
        width = spec.slots * spec.max_rank
        self.buffers: dict[str, np.ndarray] = {}
        for m in spec.modules:
            self.buffers[m.a_input] = np.zeros((m.in_features, width), dtype)
            self.buffers[m.b_input] = np.zeros((width, m.out_features), dtype)
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: list[str | None] = [None] * (spec.slots + 1)  # index 0: the base model, never used
        self.holders = [0] * (spec.slots + 1)  # running requests holding each slot
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, spec.slots + 1))
        self.loads = 0  # adapters copied into a slot (first loads and reloads after eviction)
        # Called with {buffer name: index} after a slot is written (a CUDA session copies that part to the device).
        self.on_write: list[Callable[[dict], None]] = []
        self._ort_values: dict | None = None

    # registry
    def add(self, name: str, path: str | Path) -> LoraAdapter:
        if not isinstance(name, str) or not name:
            raise LlmcError(f"LoRA adapter name {name!r}: must be a non-empty string")
        if name in self.adapters:
            raise LlmcError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path}); remove it "
                            "first or pick another name")
        adapter = read_adapter(name, path, self.spec)
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise LlmcError(f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(self.adapters) or 'none'})")
        slot = self.slot_of(name)
        if slot and self.holders[slot]:
            raise LlmcError(f"LoRA adapter {name!r} is in use by {self.holders[slot]} running requests; remove it "
                            "when they finish")
        if slot:
            self.resident[slot] = None
        del self.adapters[name]

    def slot_of(self, name: str) -> int:
        """The slot holding ``name``'s weights, or 0."""
        try:
            return self.resident.index(name, 1)
        except ValueError:
            return 0

    # slots
    def acquire(self, name: str) -> int:
        """A slot holding ``name`` for one more running request, or 0 when every slot is held (wait)."""
        slot = self.slot_of(name)
        if not slot:
            free = [s for s in self._lru if self.holders[s] == 0]  # least recently used first
            if not free:
                return 0
            empty = [s for s in free if self.resident[s] is None]
            slot = empty[0] if empty else free[0]
            self._write(slot, self.adapters[name])
        self.holders[slot] += 1
        self._lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot:
            self.holders[slot] -= 1

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        r, start = self.spec.max_rank, (slot - 1) * self.spec.max_rank
        for m in self.spec.modules:
            a_buf, b_buf = self.buffers[m.a_input], self.buffers[m.b_input]
            a_buf[:, start: start + r] = 0
            b_buf[start: start + r] = 0
            if m.module in adapter.weights:
                a, b = adapter.weights[m.module]
                a_buf[:, start: start + adapter.rank] = a.T
                b_buf[start: start + adapter.rank] = b.T
        self.resident[slot] = adapter.name
        self.loads += 1
        if self.on_write:
            cols, rows = (slice(None), slice(start, start + r)), (slice(start, start + r),)
            written = {name: index for m in self.spec.modules for name, index in ((m.a_input, cols), (m.b_input, rows))}
            for callback in self.on_write:
                callback(written)

    def bind(self, feeds: dict, slots: list[int], counts: list[int], buffers: str = "numpy") -> None:
        """Add the step's inputs to ``feeds``: every token's slot (its chunk's), and the slot buffers as numpy
        arrays (``buffers="numpy"``), as ONNX Runtime OrtValues over the same memory (``"ortvalue"``: saves ONNX
        Runtime a copy of every buffer per step, 2.5 of 11 ms on the default model with 4 slots of rank 16), or
        not at all (``"device"``: the session holds them)."""
        feeds[self.spec.slot_input] = np.repeat(np.asarray(slots, np.int64), counts)
        if buffers == "ortvalue":
            if self._ort_values is None:
                import onnxruntime as ort

                self._ort_values = {n: ort.OrtValue.ortvalue_from_numpy(b) for n, b in self.buffers.items()}
            feeds.update(self._ort_values)
        elif buffers == "numpy":
            feeds.update(self.buffers)
