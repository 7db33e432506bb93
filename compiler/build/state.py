"""What the build's stages hand each other: one :class:`BuildState` per build, filled in stage by stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmc.compiler.build.plan import Plan
from llmc.compiler.checkpoint import Checkpoint

Progress = Callable[[str], None]


@dataclass
class BuildState:
    """``timings`` are seconds per stage; ``info`` goes to the unsealed build_info.json; ``build`` is the driver's
    build function (the self-check builds its twin with it)."""

    ckpt: Checkpoint
    digest: str
    plan: Plan
    dest: Path
    say: Progress
    timings: dict[str, float]
    t0: float
    peaks: Any  # llmc.memory.StagePeaks
    build: Callable[..., Any]
    info: dict = field(default_factory=dict)
    # quantize: the quantization stage (its graph pass runs in the pipeline) and the pipeline it joins
    qstage: Any = None
    passes: list = field(default_factory=list)
    fusions: frozenset[str] = frozenset()
    # self-check: pending beside tracing, then its result
    pending: Any = None
    check: Any = None
    # trace and passes
    traced: Any = None  # llmc.compiler.frontend.Traced
    lora: Any = None  # llmc.passes.lora.LoraSpec
    nodes_traced: int = 0
    verifier: Any = None
    pass_stats: list = field(default_factory=list)
    mxfp4: int = 0
    mxfp4_outcome: Any = None  # llmc.passes.recipe.Outcome of the mxfp4-experts pass
    # emit, write, score
    emitted: Any = None  # llmc.compiler.backends.protocol.Emitted
    graphs: dict = field(default_factory=dict)  # further graphs of the artifact: name -> manifest entry
    report: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)
    cpu_fields: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)

    def phase(self, title: str, n: int) -> None:
        """Start progress phase ``n`` of 5 (its own peak-memory figure)."""
        self.peaks.stop()
        self.peaks.start(PHASE_KEYS[n])
        self.say(f"[{n}/5] {title}")


PHASE_KEYS = {2: "trace", 3: "passes", 4: "emit", 5: "write"}
