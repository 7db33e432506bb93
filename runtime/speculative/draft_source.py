"""What speculation takes of a draft engine: :class:`DraftModel`, the parts :class:`DraftProposer` drives, and
:class:`DraftSource`, what gives them (a loaded ``Engine`` does). Its own module, so that speculation never imports
the engine, which imports speculation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass
class DraftModel:
    """The parts of a loaded draft engine that ``DraftProposer`` drives. ``session`` runs a packed step
    (``run(feeds, pool)`` -> logits ``[rows, vocab]``), ``pool`` and ``blocks`` are the draft's own KV pool and
    block manager, ``rope_lengths`` whether its graph takes each token's sequence length."""

    path: Path
    vocab_size: int
    session: Any
    pool: Any
    blocks: Any
    rope_lengths: bool = False


class DraftSource(Protocol):
    """A loaded draft engine: ``llmc.runtime.Engine`` is one."""

    def draft_model(self) -> DraftModel:
        """Its parts, for a ``DraftProposer``."""
        ...
