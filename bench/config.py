"""What ``llmc bench`` runs (:class:`BenchConfig`) and what it returns (:class:`BenchResult`)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from llmc.errors import LlmcError

WORKLOADS = ("prefill", "decode", "stream")


@dataclass
class BenchConfig:
    """What ``llmc bench`` runs. Lengths in tokens; ``stream_rate`` in requests per second."""

    workloads: tuple[str, ...] = WORKLOADS
    batches: tuple[int, ...] = (1, 8, 32)
    input_len: int = 128
    output_len: int = 128
    prefill_len: int = 512
    repeats: int = 3
    warmup: int = 1
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    stream_requests: int = 16
    stream_rate: float = 4.0
    seed: int = 0
    speculative: str | None = None  # "ngram" or "draft:PATH": speculative decoding (SpeculativeConfig.parse)
    image: str | None = None  # an image file: time the engine's image path too (bench/image.py)

    def validate(self, max_model_len: int | None = None, source: str = "") -> None:
        """Raise :class:`LlmcError` naming the flag, the constraint and the fix."""
        if self.speculative:
            from llmc.runtime.speculative.config import SpeculativeConfig

            SpeculativeConfig.parse(self.speculative)  # raises naming --speculative
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise LlmcError(f"--workloads: unknown workload {bad[0] if bad else '(none)'!r}; choose from "
                            f"{', '.join(WORKLOADS)} (comma-separated)")
        for flag, value, low in (("--input-len", self.input_len, 1), ("--output-len", self.output_len, 2),
                                 ("--prefill-len", self.prefill_len, 1), ("--repeats", self.repeats, 1),
                                 ("--warmup", self.warmup, 0), ("--threads", self.threads, 1),
                                 ("--stream-requests", self.stream_requests, 1)):
            if value < low:
                why = " (decode is timed between the first and the last new token)" if flag == "--output-len" else ""
                raise LlmcError(f"{flag} {value}: must be at least {low}{why}")
        if not self.batches or min(self.batches) < 1:
            raise LlmcError(f"--batch {','.join(map(str, self.batches)) or '(none)'}: every batch size must be "
                            "at least 1, e.g. --batch 1,8,32")
        if self.stream_rate <= 0:
            raise LlmcError(f"--stream-rate {self.stream_rate}: must be positive (requests per second)")
        if max_model_len:
            need = {"--input-len + --output-len": self.input_len + self.output_len}
            if "prefill" in self.workloads:
                need["--prefill-len + 1"] = self.prefill_len + 1
            for what, n in need.items():
                if n > max_model_len:
                    raise LlmcError(f"{what} = {n} tokens exceeds the engine's context of {max_model_len} tokens "
                                    f"({source}max_position_embeddings); lower them")


@dataclass
class BenchResult:
    engine: str
    config: dict
    model: dict
    weights: dict
    kv_bytes_per_token: int
    machine: dict
    rows: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)
