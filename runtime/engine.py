"""``Engine``: load an artifact and generate, packing every active request into each step.

Each step takes, for every running request, the tokens it has not yet computed (its whole prompt
on the first step, one token per step afterwards), bounded by a per-step token budget, so long
prompts are prefilled in chunks. Logits are computed only for requests whose step reaches their
last known token; those sample one new token.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime import artifact
from llmc.runtime.kv_cache import BlockManager, KVPool
from llmc.runtime.sampler import SamplingParams, sample
from llmc.runtime.session import OrtSession
from llmc.runtime.tokenizer import Tokenizer


@dataclass
class GenerationOutput:
    """One finished request. Times in seconds; ``ttft`` is time to first token."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    ttft: float = 0.0
    latency: float = 0.0


@dataclass
class _Request:
    index: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    rng: np.random.Generator
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Engine:
    """A loaded engine. Create with :meth:`load`."""

    def __init__(self, path: Path, manifest: dict, session: OrtSession, pool: KVPool, blocks: BlockManager,
                 tokenizer: Tokenizer | None, eos_ids: list[int], max_num_tokens: int) -> None:
        self.path = path
        self.manifest = manifest
        self._session = session
        self._pool = pool
        self._blocks = blocks
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_ids
        self.max_num_tokens = max_num_tokens
        self.block_size = pool.block_size
        self.max_model_len = int(manifest.get("engine", {}).get("max_position_embeddings", 0)) or None

    @classmethod
    def load(cls, path: str | Path, *, kv_cache_tokens: int = 16384, max_num_tokens: int = 2048,
             num_threads: int | None = None, verify: bool = True) -> Engine:
        """Load the artifact at ``path``.

        ``kv_cache_tokens`` sizes the KV pool (tokens across all sequences); ``max_num_tokens``
        bounds the tokens computed in one step. With ``verify`` (default) every file's sha256 is
        checked first and a modified or missing file is refused, naming it.
        """
        root = Path(path)
        manifest = artifact.require_valid(root) if verify else artifact.read_manifest(root)
        engine_info, kv = manifest["engine"], manifest["kv_cache"]
        if engine_info.get("backend") != "onnxruntime":
            raise LlmcError(
                f"{root / artifact.MANIFEST}: engine backend {engine_info.get('backend')!r} cannot run on this "
                "machine (this runtime runs 'onnxruntime' CPU engines); build with --target cpu"
            )
        session = OrtSession(root / engine_info["model_file"], num_threads=num_threads or os.cpu_count())
        block_size = int(kv["block_size"])
        num_blocks = max(1, -(-kv_cache_tokens // block_size))
        pool = KVPool.allocate(kv["num_layers"], num_blocks, kv["num_kv_heads"], block_size, kv["head_size"],
                               kv["dtype"])
        tokenizer = Tokenizer(root) if (root / "tokenizer.json").is_file() else None
        return cls(root, manifest, session, pool, BlockManager(num_blocks), tokenizer, _eos_ids(root),
                   max_num_tokens)

    # -- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Generate for every prompt (text, or a list of token ids), all packed together per step."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise LlmcError(f"generate: {len(prompts)} prompts but {len(plist)} SamplingParams; pass one or one each")
        requests = [self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
        start = time.perf_counter()
        active = list(requests)
        finish_times: dict[int, float] = {}
        try:
            while active:
                self._step(active)
                now = time.perf_counter()
                for r in active:
                    if r.finish_reason is not None:
                        finish_times[r.index] = now
                        self._blocks.free(r.blocks)
                        r.blocks = []
                active = [r for r in active if r.finish_reason is None]
        finally:
            for r in active:
                self._blocks.free(r.blocks)
                r.blocks = []
        outputs = []
        for r in requests:
            text = self.tokenizer.decode(r.generated) if self.tokenizer else None
            outputs.append(GenerationOutput(
                prompt_token_ids=r.tokens[: r.prompt_len],
                token_ids=r.generated,
                text=text,
                finish_reason=r.finish_reason or "length",
                ttft=(r.first_token_time or start) - start,
                latency=finish_times.get(r.index, start) - start,
            ))
        return outputs

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Logits ``[len(token_ids), vocab]`` (float32) for every position of one sequence, in one step.

        Used for perplexity and for comparing engines position by position.
        """
        n = len(token_ids)
        if n == 0:
            raise LlmcError("score: token_ids is empty")
        blocks = self._blocks.allocate(-(-n // self.block_size))
        try:
            p = np.arange(n, dtype=np.int64)
            table = np.asarray(blocks, np.int64)
            feeds = {
                "input_ids": np.asarray(token_ids, np.int64),
                "positions": p,
                "slot_mapping": table[p // self.block_size] * self.block_size + p % self.block_size,
                "block_tables": table[None, :],
                "context_lens": np.asarray([n], np.int64),
                "query_start_loc": np.asarray([0, n], np.int64),
                "logits_indices": p,
            }
            return self._session.run(feeds, self._pool)
        finally:
            self._blocks.free(blocks)

    def _make_request(self, index: int, prompt, params: SamplingParams) -> _Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LlmcError(f"{self.path}: engine has no tokenizer.json; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise LlmcError(f"prompt {index} is empty after tokenization; give at least one token")
        vocab = self.manifest["engine"]["vocab_size"]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise LlmcError(f"prompt {index}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        needed = -(-(len(ids) + params.max_tokens) // self.block_size)
        if needed > self._blocks.num_blocks:
            raise LlmcError(
                f"prompt {index}: {len(ids)} prompt + {params.max_tokens} new tokens need {needed} KV blocks but "
                f"the pool has {self._blocks.num_blocks}; raise kv_cache_tokens or lower max_tokens"
            )
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        return _Request(index, ids, len(ids), params, np.random.default_rng(seed))

    def _step(self, active: list[_Request]) -> None:
        budget = self.max_num_tokens
        chunks: list[tuple[_Request, int]] = []
        for r in active:
            n = min(len(r.tokens) - r.computed, budget)
            if n <= 0:
                continue
            need = -(-(r.computed + n) // self.block_size) - len(r.blocks)
            if need > 0:
                r.blocks += self._blocks.allocate(need)
            chunks.append((r, n))
            budget -= n
        ids, pos, slots, qsl, ctx, logit_rows, sampled = [], [], [], [0], [], [], []
        max_blocks = max(len(r.blocks) for r, _ in chunks)
        tables = np.zeros((len(chunks), max_blocks), np.int64)
        for s, (r, n) in enumerate(chunks):
            p = np.arange(r.computed, r.computed + n)
            ids.extend(r.tokens[r.computed : r.computed + n])
            pos.append(p)
            blocks = np.asarray(r.blocks, np.int64)
            slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
            tables[s, : len(r.blocks)] = blocks
            ctx.append(r.computed + n)
            qsl.append(qsl[-1] + n)
            if r.computed + n == len(r.tokens):
                logit_rows.append(qsl[-1] - 1)
                sampled.append(r)
        feeds = {
            "input_ids": np.asarray(ids, np.int64),
            "positions": np.concatenate(pos).astype(np.int64),
            "slot_mapping": np.concatenate(slots).astype(np.int64),
            "block_tables": tables,
            "context_lens": np.asarray(ctx, np.int64),
            "query_start_loc": np.asarray(qsl, np.int64),
            "logits_indices": np.asarray(logit_rows, np.int64),
        }
        logits = self._session.run(feeds, self._pool)
        for r, n in chunks:
            r.computed += n
        now = time.perf_counter()
        for row, r in enumerate(sampled):
            token = sample(logits[row], r.params, r.rng)
            r.tokens.append(token)
            if r.first_token_time is None:
                r.first_token_time = now
            p = r.params
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                r.finish_reason = "stop"
            elif len(r.generated) >= p.max_tokens:
                r.finish_reason = "length"


def _eos_ids(root: Path) -> list[int]:
    import json

    for name in ("generation_config.json", "hf_config.json"):
        f = root / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
