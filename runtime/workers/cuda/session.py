"""The CUDA engine's session: runs a program (:mod:`.torch_program`) on a device with a paged KV pool.

Used by :class:`llmc.runtime.engine.Engine` for engines whose backend is ``cuda``, exactly where an
ONNX Runtime engine uses :class:`llmc.runtime.workers.ort.session.OrtSession`: the scheduler, sampler and the
rest of the ``Engine`` API are shared. Imported only when such an engine is loaded (it imports torch).

- ``device="cuda"``: weights and the KV pool in device memory; ``PagedAttention`` runs the engine's
  ahead-of-time Triton kernels through the driver (:mod:`.cuda_kernels`): the flash kernels
  (plugins/paged_attention/flash.py: FlashAttention-2-style prefill, split-KV decode + reduce), or the first
  kernel in engines built before them or with heads past 256; decode steps (one new
  token per sequence, every sequence sampled) are replayed from CUDA graphs captured per padded
  batch size (1, 2, 4, ... up to ``max_graph_batch``); prefill and mixed steps run eagerly.
- ``device="cpu"``: the same program on torch's CPU ops with attention in plain torch: how CI tests
  the lowering and the executor with no GPU.
- ``device="meta"``: a dry run of what a GPU launches (shapes only, no weights read, the AOT kernels recording
  their launches): :mod:`.launches` counts a decode step's kernels with it.

The ops that launch the AOT kernels (fused norms, rotary, SwiGLU, the FP8 / INT4 linears, LoRA) are
:class:`.fused_ops.FusedOps`.

Hybrid models (manifest ``state_cache``): the session owns the state pool too (:meth:`CudaSession.allocate_state`,
float32 arrays ``[num_slots, ...]`` on the device; the engine's
:class:`~llmc.runtime.core.state_cache.StatePool` hands out the slots), and runs the recurrent ops
(``CausalConv1d``, ``GatedDeltaRule``, ``SsdScan``) with their AOT Triton kernels, or their torch references
(llmc.plugins.recurrent.torch_reference) where no kernel was built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmc.errors import UnsupportedError
from llmc.plugins.fused.requests import INT4_NUM_SMS
from llmc.plugins.paged_attention.flash_requests import VARIANTS as FLASH_VARIANTS
from llmc.plugins.paged_attention.flash_requests import FlashKernels, run_attention
from llmc.runtime.core.kv_cache import distinct_pairs, layer_geometry
from llmc.runtime.sampling.sampler import SampleRow
from llmc.runtime.workers.cuda import kernels as cuda_kernels
from llmc.runtime.workers.cuda.fused_ops import FusedOps
from llmc.runtime.workers.cuda.ops import DTYPES, paged_attention_torch
from llmc.runtime.workers.cuda.program import ATTENTION_OP, STATE_OPS, Program, load_weights, meta_weights, read_spec
from llmc.runtime.workers.cuda.sampler import sample_rows

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_META = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
         "logits_indices")
# An image engine's further inputs (runtime/image_inputs.py); a decode step feeds them empty (attend_end: zeros)
_IMAGE_FEEDS = ("image_embeds", "image_rows", "attend_end")


@dataclass
class TorchKVPool:
    """Per-layer K and V caches ``[num_blocks, num_kv_heads, block_size, head_size]`` as torch tensors."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
                 dtype: torch.dtype, device: torch.device, layers: list[dict] | None = None) -> TorchKVPool:
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (owner, h, d) in enumerate(layer_geometry(num_layers, num_kv_heads, head_size, layers)):
            shape = (num_blocks, h, block_size, d)
            out.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       if owner == i else out[owner])
        return cls(out, block_size)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_size: int,
                        dtype: torch.dtype, layers: list[dict] | None = None) -> int:
        geometry = layer_geometry(num_layers, num_kv_heads, head_size, layers)
        per_token = sum(h * d for i, (owner, h, d) in enumerate(geometry) if owner == i)
        return 2 * per_token * block_size * torch.tensor([], dtype=dtype).element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        dev = self.layers[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dev)
        for k, v in distinct_pairs(self.layers):  # a KV-shared layer's caches are its owner's
            k[dst] = k[src]
            v[dst] = v[src]


def _pool_dtype(name: str) -> torch.dtype:
    """The KV pool's torch dtype: an FP8 cache holds E4M3 codes as bytes (the attention kernels read uint8)."""
    return torch.uint8 if name == "float8_e4m3fn" else DTYPES[name]


def attention_key(attrs: dict) -> str:
    """The configuration an attention kernel is specialised for (the compiler names kernels by it)."""
    return (f"h{attrs['num_heads']}-kv{attrs['num_kv_heads']}-d{attrs['head_size']}-s{float(attrs['scale']):.9g}"
            f"-w{int(attrs.get('sliding_window', 0))}-c{float(attrs.get('softcap', 0.0)):g}"
            + ("-sinks" if attrs.get("has_sinks") else "")
            + (f"-alibi{float(attrs['alibi_max_bias']):g}" if attrs.get("alibi_max_bias") else "")
            + (f"-chunk{int(attrs['attention_chunk'])}" if attrs.get("attention_chunk") else "")
            + ("-ae" if attrs.get("has_attend_end") else ""))


class CudaSession:
    """Executes a CUDA engine's program. ``run(feeds, pool)`` as
    :class:`~llmc.runtime.workers.ort.session.OrtSession`."""

    spinning = False
    samples_on_device = True  # the engine samples plain rows with sample(), reading only ids back
    spin_reason = "CUDA engine (ONNX Runtime's thread pool is not used)"

    def __init__(self, root: Path, manifest: dict, device: str = "cuda", cuda_graphs: bool = True,
                 max_graph_batch: int = 64, max_model_len: int | None = None, interpret_kernels: bool = False) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device, by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        engine = manifest["engine"]
        spec = read_spec(root)
        self.dtype = DTYPES[spec["dtype"]]
        self.input_names = tuple(spec["inputs"])
        # the width of image_embeds [M, hidden] (an image engine): a decode graph captures it with no rows
        mm = manifest.get("multimodal") or {}
        self._image_width = int(mm.get("hidden_size") or 0) * (1 + int(mm.get("deepstack_layers") or 0))
        self._pool: TorchKVPool | None = None
        on_gpu = self.device.type == "cuda"
        meta = self.device.type == "meta"  # a dry run: what a GPU would launch, recorded (launches.py)
        self.launch_log: list = []
        if on_gpu:
            torch.cuda.set_device(self.device)
        if on_gpu:
            self.kernels = cuda_kernels.load_kernels(root, engine.get("kernels", []))
        elif meta:
            self.kernels = cuda_kernels.load_kernels(root, engine.get("kernels", []), record=self.launch_log)
        elif interpret_kernels:  # tests: the fused and flash attention kernels' launch path under the interpreter
            self.kernels = cuda_kernels.load_kernels(root, engine.get("kernels", []), interpret=True)
        else:
            self.kernels = {}
        self.attention_route = "aot-triton" if (on_gpu or meta) and self.kernels else "torch"
        if on_gpu and os.environ.get("LLMC_CUDA_ATTENTION") == "torch":  # debugging: the plain-torch attention
            self.kernels, self.attention_route = {}, "torch"
        # layer -> [k_scale, v_scale] of an FP8 cache (ones otherwise), made once: CUDA graphs capture their addresses
        self._kv_scales = {int(n["attrs"]["layer_idx"]): torch.tensor(
            [n["attrs"].get("k_scale", 1.0), n["attrs"].get("v_scale", 1.0)], dtype=torch.float32, device=self.device)
            for n in spec["nodes"] if n["op"] == ATTENTION_OP}
        self._state: list[torch.Tensor] | None = None  # a hybrid model's state pool (allocate_state)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else INT4_NUM_SMS
        self._num_sms = sms  # the split-KV rule's (flash_requests.decode_num_splits)
        self._flash = self._flash_kernels(spec)
        fused = FusedOps(self._fused, self._launch, self.dtype, self.device, sms) if self.kernels else None
        overrides = fused.overrides() if fused is not None else {}
        if any(n["op"] in STATE_OPS for n in spec["nodes"]):
            overrides.update(self._state_ops())
        weights = meta_weights(root, spec) if meta else load_weights(root, spec, self.device)
        self.program = Program(spec, weights, self._attention, overrides)
        if meta:
            self.program.constants_to(self.device)
        if fused is not None:  # the FP8 linears' scales, folded once here (their kernels' scale_b)
            self.program.prepare("Fp8Linear", fused.prepare_fp8_linear)
        self.cuda_graphs = bool(cuda_graphs and on_gpu and self.kernels)
        self.graph_batches = tuple(b for b in GRAPH_BATCHES if b <= max_graph_batch)
        kv = manifest["kv_cache"]
        self._max_blocks = -(-int(max_model_len or 4096) // int(kv["block_size"]))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self._graph_pool = None
        self.graph_replays = 0
        self.eager_steps = 0
        self.rows_sampled_on_device = 0
        # A LoRA engine's slot buffers in device memory, in the engine dtype (bind_lora); fed to every step.
        self.lora_buffers: dict[str, torch.Tensor] = {}

    def bind_lora(self, lora) -> None:
        """Keep ``lora``'s (llmc.runtime.lora.slots.LoraSlots) slot buffers on the device: copied once here, then
        only the slot an adapter is written into (not every step)."""
        self.lora_buffers = {name: torch.from_numpy(buf).to(self.device, self.dtype)
                             for name, buf in lora.buffers.items()}
        self._graphs.clear()  # graphs captured before hold no slot inputs

        def written(cols_or_rows: dict) -> None:
            for name, index in cols_or_rows.items():
                self.lora_buffers[name][index] = torch.from_numpy(lora.buffers[name][index]).to(self.device,
                                                                                                self.dtype)

        lora.on_write.append(written)

    # -- KV pool ----------------------------------------------------------------------------------

    def allocate_pool(self, kv: dict, num_blocks: int) -> TorchKVPool:
        self._graphs.clear()  # graphs hold pointers into the pool they were captured with
        self._pool = TorchKVPool.allocate(kv["num_layers"], num_blocks, kv["num_kv_heads"], kv["block_size"],
                                          kv["head_size"], _pool_dtype(kv["dtype"]), self.device, kv.get("layers"))
        return self._pool

    def allocate_state(self, state_cache: dict, num_slots: int) -> list[torch.Tensor]:
        """The state pool of a hybrid model: per array of the manifest's ``state_cache.arrays``, float32
        ``[num_slots, *shape]`` zeros on the device (never cleared: a fresh sequence starts from zeros in the op)."""
        self._graphs.clear()  # graphs hold pointers into the pool they were captured with
        self._state = [torch.zeros((num_slots, *(int(d) for d in a["shape"])), dtype=torch.float32,
                                   device=self.device) for a in state_cache["arrays"]]
        return self._state

    def blocks_that_fit(self, kv: dict, gpu_memory_utilization: float, reserve_bytes: int) -> int:
        """KV blocks that fit in ``gpu_memory_utilization`` of the device's memory after the weights."""
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - (1.0 - gpu_memory_utilization) * total - reserve_bytes
        per = TorchKVPool.bytes_per_block(kv["num_layers"], kv["num_kv_heads"], kv["block_size"], kv["head_size"],
                                          _pool_dtype(kv["dtype"]), kv.get("layers"))
        return max(0, int(budget // per))

    # -- attention --------------------------------------------------------------------------------

    def _flash_kernels(self, spec: dict) -> dict[str, FlashKernels]:
        """attention key -> the flash prefill / split-KV decode / reduce kernels of that configuration, where the
        engine has all three (engines built before them, and heads past 256, have the first kernel instead)."""
        out = {}
        for n in spec["nodes"]:
            if n["op"] != ATTENTION_OP:
                continue
            a = n["attrs"]
            key = attention_key(a)
            found = [self.kernels.get((key, v)) for v in FLASH_VARIANTS]
            if key in out or any(k is None for k in found):
                continue
            prefill = found[0]
            out[key] = FlashKernels(prefill=prefill, decode=found[1], reduce=found[2],
                                    block_q=int(prefill.info.block_q), num_kv_heads=int(a["num_kv_heads"]),
                                    num_heads=int(a["num_heads"]), head_size=int(a["head_size"]),
                                    sinks=bool(prefill.info.config.get("HAS_SINKS")),
                                    attend_end=bool(prefill.info.config.get("HAS_ATTEND_END")))
        return out

    def _attention(self, attrs, query, key, value, slot_mapping, block_tables, context_lens, query_start_loc,
                   sinks=None, attend_end=None):
        layer = attrs["layer_idx"]
        k_cache, v_cache = self._pool.layers[layer]
        scales = self._kv_scales[layer]
        t, s = query.shape[0], context_lens.shape[0]
        akey = attention_key(attrs)
        flash = self._flash.get(akey)
        kernel = None if flash is not None else self.kernels.get((akey, "decode" if t <= s else "prefill"))
        built_sinks = flash.sinks if flash is not None else kernel.info.config.get("sinks", False) if kernel else None
        if built_sinks is not None and (sinks is not None) != built_sinks:
            raise RuntimeError(f"layer {layer}: the attention kernels were built "
                               f"{'without' if sinks is not None else 'with'} attention sinks, but the program "
                               f"{'passes' if sinks is not None else 'does not pass'} them; rebuild the engine")
        if flash is not None:
            # FlashAttention-2-style prefill, or split-KV decode + reduce (every chunk of a step with T == S rows is
            # one decode row: the scheduler gives each chunk at least one token).
            return run_attention(flash, query, key, value, slot_mapping, block_tables, context_lens,
                                 query_start_loc, k_cache, v_cache, scales, sinks=sinks, attend_end=attend_end,
                                 num_sms=self._num_sms, stream=self._stream())
        if kernel is None or (attend_end is not None and not kernel.info.config.get("attend_end", False)):
            return paged_attention_torch(query, key, value, slot_mapping, block_tables, context_lens,
                                         query_start_loc, k_cache, v_cache, num_heads=attrs["num_heads"],
                                         num_kv_heads=attrs["num_kv_heads"], scale=attrs["scale"],
                                         sliding_window=attrs.get("sliding_window", 0),
                                         softcap=attrs.get("softcap", 0.0), kv_scales=scales, sinks=sinks,
                                         alibi_max_bias=float(attrs.get("alibi_max_bias", 0.0)),
                                         attention_chunk=int(attrs.get("attention_chunk", 0)), attend_end=attend_end)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out = torch.empty_like(query)
        info = kernel.info
        grid = (-(-t // info.block_q) + s, info.num_kv_heads, 1)
        # The first kernel (heads past 256): sinks (float32 [num_heads]) then attend_end after kv_scales, where
        # it was built with them (aot.params_for).
        extra = [x for x in (sinks, attend_end) if x is not None]
        kernel.launch(grid, [query, key, value, slot_mapping, block_tables, context_lens, query_start_loc,
                             k_cache, v_cache, scales, *extra, s, block_tables.shape[1], out, k_cache, v_cache],
                      self._stream())
        return out

    # -- recurrent-state ops (hybrid models) ------------------------------------------------------

    def _state_ops(self) -> dict:
        """``CausalConv1d``, ``GatedDeltaRule``, ``SsdScan`` on the session's state pool: the node's AOT kernel
        (attribute ``kernel``) where one was loaded and the inputs are in the engine dtype, else the torch reference."""
        from llmc.plugins.recurrent import torch_reference as ref

        def pool(idx: int) -> torch.Tensor:
            if self._state is None:
                raise RuntimeError("a recurrent-state op ran before the state pool was allocated (allocate_state)")
            return self._state[idx]

        def rows(*ts):  # contiguous rows in the engine dtype: what the kernels read
            return [t.to(self.dtype).contiguous() for t in ts]

        def conv(x, weight, bias, state_slots, context_lens, query_start_loc, *, state_idx, activation=0,
                 kernel=None, **_):
            k, state = self._fused(kernel), pool(state_idx)
            if k is None or x.dtype != self.dtype:
                return (ref.causal_conv1d(x, weight, bias, state_slots, context_lens, query_start_loc, state,
                                          activation),)
            x, weight = rows(x, weight)
            b = rows(bias)[0] if bias is not None else weight
            out = torch.empty_like(x)
            cfg = k.info.config
            self._launch(k, (state_slots.shape[0], -(-cfg["C"] // cfg["BLOCK_C"]), 1),
                         [x, weight, b, state_slots, context_lens, query_start_loc, state, out])
            return (out,)

        def delta(query, key, value, g, beta, state_slots, context_lens, query_start_loc, *, state_idx, num_k_heads,
                  num_v_heads, use_qk_l2norm=1, kernel=None, **_):
            k, state = self._fused(kernel), pool(state_idx)
            if k is None or value.dtype != self.dtype:
                return (ref.gated_delta_rule(query, key, value, g, beta, state_slots, context_lens, query_start_loc,
                                             state, num_k_heads, num_v_heads, bool(use_qk_l2norm)),)
            q, kk, v, g, beta = rows(query, key, value, g, beta)
            out = torch.empty_like(v)
            cfg = k.info.config
            self._launch(k, (state_slots.shape[0], cfg["HV"], -(-cfg["DV"] // cfg["BLOCK_V"])),
                         [q, kk, v, g, beta, state_slots, context_lens, query_start_loc, state, out])
            return (out,)

        def ssd(x, b, c, dt, a_log, d, dt_bias, state_slots, context_lens, query_start_loc, *, state_idx, num_heads,
                n_groups, dt_min=0.0, dt_max=float("inf"), kernel=None, **_):
            k, state = self._fused(kernel), pool(state_idx)
            if k is None or x.dtype != self.dtype:
                return (ref.ssd_scan(x, b, c, dt, a_log, d, dt_bias, state_slots, context_lens, query_start_loc,
                                     state, num_heads, n_groups, dt_min, dt_max),)
            ins = rows(x, b, c, dt, a_log, d, dt_bias)
            out = torch.empty_like(ins[0])
            cfg = k.info.config
            self._launch(k, (state_slots.shape[0], cfg["H"], -(-cfg["P"] // cfg["BLOCK_P"])),
                         [*ins, state_slots, context_lens, query_start_loc, state, out])
            return (out,)

        return {"CausalConv1d": conv, "GatedDeltaRule": delta, "SsdScan": ssd}

    # -- fused kernels (RMSNorm, rotary, SwiGLU) ---------------------------------------------------

    def _fused(self, key: str | None):
        return self.kernels.get((key, "fused")) if key else None

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def _launch(self, kernel, grid, args) -> None:
        kernel.launch(grid, args, self._stream())

    # -- steps ------------------------------------------------------------------------------------

    def run(self, feeds: dict[str, np.ndarray], pool: TorchKVPool, state: list | None = None) -> np.ndarray:
        """Run one step; returns logits ``[n_logits, vocab]`` (float32, host). ``state``: the recurrent-state pool
        the engine passes every session: None, or this session's own (allocate_state), which the ops already use."""
        if state is not None and state is not self._state:
            raise UnsupportedError("the CUDA engine runs recurrent layers on the state pool it allocated "
                                   "(CudaSession.allocate_state), not on another one")
        return self.host_rows(self.run_device(feeds, pool))

    def host_rows(self, logits: torch.Tensor, rows: list[int] | None = None) -> np.ndarray:
        """``logits[rows]`` (all rows if None) as float32 on the host."""
        if rows is not None:
            logits = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
        return logits.float().cpu().numpy()

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample ``rows`` of a step's device logits where they are (:func:`.device_sampler.sample_rows`)."""
        self.rows_sampled_on_device += len(rows)
        return sample_rows(logits, rows)

    def run_device(self, feeds: dict[str, np.ndarray], pool: TorchKVPool) -> torch.Tensor:
        """Run one step; returns logits ``[n_logits, vocab]`` on the device, in the program's output dtype.

        A replayed graph's logits live in its static output buffer: read them before the next step.
        """
        if pool is not self._pool:
            self._pool = pool
            self._graphs.clear()
        s = len(feeds["context_lens"])
        t = len(feeds["input_ids"])
        n = len(feeds["logits_indices"])
        bucket = next((b for b in self.graph_batches if b >= s), None) if self.cuda_graphs else None
        if (bucket is not None and t == s == n and feeds["block_tables"].shape[1] <= self._max_blocks
                and set(feeds) == set(_META) | ({"lora_slots"} if self.lora_buffers else set())
                | ({"state_slots"} if self._state is not None else set()) | self._idle_image_feeds(feeds)):
            logits = self._replay(bucket, feeds)[:n]
            self.graph_replays += 1
        else:
            dev = self.device
            tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in feeds.items()}
            tensors.update(self.lora_buffers)
            with torch.inference_mode():
                logits = self.program.run(tensors)[0]
            self.eager_steps += 1
        return logits

    def _idle_image_feeds(self, feeds: dict[str, np.ndarray]) -> set[str]:
        """The image inputs of an image engine's step that places no image row (every decode step): a captured
        graph holds them as constants (no rows; attend_end zeros), so such steps replay like a text engine's."""
        names = {n for n in _IMAGE_FEEDS if n in feeds}
        idle = all(len(feeds[n]) == 0 for n in names & {"image_embeds", "image_rows"}) and \
            ("attend_end" not in names or not np.any(feeds["attend_end"]))
        return names if names and idle else set()

    def _static_feeds(self, b: int) -> dict[str, torch.Tensor]:
        z = dict(dtype=torch.int64, device=self.device)
        image = {}
        if "image_embeds" in self.input_names:  # an image engine's decode step: no image rows
            width = self._image_width
            image = {"image_embeds": torch.zeros((0, width), dtype=torch.float32, device=self.device),
                     "image_rows": torch.zeros(0, **z)}
        if "attend_end" in self.input_names:
            image["attend_end"] = torch.zeros(b, **z)
        return {"input_ids": torch.zeros(b, **z), "positions": torch.zeros(b, **z),
                "slot_mapping": torch.full((b,), -1, **z), "block_tables": torch.zeros(b, self._max_blocks, **z),
                "context_lens": torch.ones(b, **z), "query_start_loc": torch.arange(b + 1, **z),
                "logits_indices": torch.arange(b, **z),
                # A LoRA engine: the tokens' slots, and the slot buffers (written in place: the graph keeps them).
                **({"lora_slots": torch.zeros(b, **z), **self.lora_buffers} if self.lora_buffers else {}),
                # A hybrid model: each sequence's state slot; padding rows' -1 reads a zero state and stores nothing.
                **({"state_slots": torch.full((b,), -1, **z)} if self._state is not None else {}), **image}

    def _capture(self, b: int):
        static = self._static_feeds(b)  # padding everywhere: slot -1 writes nothing while warming up
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):
                self.program.run(static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._graph_pool):
            out = self.program.run(static)[0]
        return graph, static, out

    def _replay(self, b: int, feeds: dict[str, np.ndarray]) -> torch.Tensor:
        entry = self._graphs.get(b)
        if entry is None:
            entry = self._graphs[b] = self._capture(b)
        graph, static, out = entry
        s = len(feeds["context_lens"])
        host = np.zeros((6, b), np.int64)
        host[0, :s] = feeds["input_ids"]
        host[1, :s] = feeds["positions"]
        host[2, :] = -1
        host[2, :s] = feeds["slot_mapping"]
        host[3, :] = 1
        host[3, :s] = feeds["context_lens"]
        if "lora_slots" in static:
            host[4, :s] = feeds["lora_slots"]  # padding rows: slot 0, no adapter
        if "state_slots" in static:
            host[5, :] = -1
            host[5, :s] = feeds["state_slots"]
        packed = torch.from_numpy(host).to(self.device, non_blocking=True)
        static["input_ids"].copy_(packed[0])
        static["positions"].copy_(packed[1])
        static["slot_mapping"].copy_(packed[2])
        static["context_lens"].copy_(packed[3])
        if "lora_slots" in static:
            static["lora_slots"].copy_(packed[4])
        if "state_slots" in static:
            static["state_slots"].copy_(packed[5])
        bt = feeds["block_tables"]
        static["block_tables"][:s, : bt.shape[1]].copy_(torch.from_numpy(np.ascontiguousarray(bt)))
        graph.replay()
        return out

    def capture_all(self) -> None:
        """Capture every decode graph now (otherwise each is captured the first time its size runs)."""
        if self.cuda_graphs and self._pool is not None:
            for b in self.graph_batches:
                if b not in self._graphs:
                    self._graphs[b] = self._capture(b)

    def end_profiling(self) -> str | None:
        return None

    def set_attention_threads(self, n: int) -> None:  # the CPU kernel's threads: nothing to set here
        del n
