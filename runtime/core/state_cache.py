"""Per-sequence state slots of hybrid models, beside the paged KV cache.

Layers that keep recurrent state between tokens (short convolutions, and later Gated DeltaNet and Mamba2
layers) do not page: each sequence needs one fixed-size state per such layer, whatever its length. The pool
holds, per state array of the manifest's ``state_cache.arrays``, one array ``[num_slots, *shape]`` in host
memory, bound to llmc's native ops by pointer as the KV pool is; the graph input ``state_slots`` names each
sequence's slot. A slot is taken when a sequence first runs and given back when it finishes or is preempted.
Nothing is ever cleared: a sequence whose step rows are its whole context starts from a zero state inside the
op, which is also how a preempted sequence, recomputed from its first token, starts over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmc.errors import LlmcError

# Why hybrid engines run without prefix caching (engine stats and the load log say it): a cached block holds
# keys and values, but a sequence resumed after a cached prefix would also need every recurrent layer's state
# at that block boundary, which this runtime does not snapshot.
NO_PREFIX_CACHING = ("recurrent layers' state is not snapshotted at block boundaries, so a prefix-cache hit could "
                     "not restore it")


@dataclass
class StatePool:
    """State arrays ``[num_slots, *shape]`` (float32) and which sequence holds which slot."""

    arrays: list[np.ndarray]
    spec: list[dict]
    _free: list[int] = field(default_factory=list)
    _slots: dict[int, int] = field(default_factory=dict)

    @classmethod
    def allocate(cls, state_cache: dict, num_slots: int) -> StatePool:
        """``state_cache`` is the manifest's section (``dtype``, ``arrays`` of ``{"layer", "kind", "shape"}``)."""
        dtype = state_cache.get("dtype", "float32")
        if dtype != "float32":
            raise LlmcError(f"state_cache.dtype {dtype!r}: this runtime keeps recurrent state in float32 only; "
                            "rebuild the engine with this llmc")
        spec = list(state_cache.get("arrays") or [])
        if not spec:
            raise LlmcError("state_cache.arrays is empty; rebuild the engine with this llmc")
        if num_slots < 1:
            raise LlmcError(f"state pool of {num_slots} slots: needs at least 1; raise max_num_seqs")
        arrays = [np.zeros((num_slots, *(int(d) for d in a["shape"])), np.float32) for a in spec]
        return cls(arrays, spec, list(range(num_slots - 1, -1, -1)))

    @staticmethod
    def bytes_per_slot(state_cache: dict) -> int:
        return sum(int(np.prod(a["shape"], dtype=np.int64)) * 4 for a in state_cache.get("arrays") or [])

    @property
    def num_slots(self) -> int:
        return self.arrays[0].shape[0]

    @property
    def num_used(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def slot_of(self, seq_id: int) -> int:
        """The slot of ``seq_id``, taking a free one the first time (``LlmcError`` when none is free)."""
        slot = self._slots.get(seq_id)
        if slot is None:
            if not self._free:
                raise LlmcError(f"state pool: all {self.num_slots} slots are in use; raise max_num_seqs")
            slot = self._slots[seq_id] = self._free.pop()
        return slot

    def release(self, seq_id: int) -> None:
        """Give ``seq_id``'s slot back (no-op if it holds none)."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
