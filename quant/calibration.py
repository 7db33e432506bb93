"""Calibration: token sequences from text, and activation statistics collected one decoder layer at a time.

The model's own torch definition (transformers) runs the calibration set through the network
layer by layer: only one layer's weights are in memory at a time (read from the checkpoint, then
released), the hidden states of the calibration set are the only activations kept between
layers, and each linear layer's input statistics are reduced on the fly into a Gram matrix
``X^T X``, per-channel mean magnitudes and the absolute maximum. A consumer (AWQ, GPTQ, the FP8
range collector) sees each layer's statistics while that layer's weights are loaded, may replace
its weights with quantized ones (GPTQ feeds the next layer the quantized layer's output), and
keeps only what it derives.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UnsupportedError

CALIB_ATTENTION = "llmc_calibration"


# -- data -------------------------------------------------------------------------------------------

def load_texts(path: str | Path | None) -> list[str]:
    """Documents for calibration: a JSONL file (one object with a ``"text"`` string per line), any
    other file as plain text (one document), or the training split of the built-in pydoc corpus."""
    if path is None:
        from llmc.testing.corpus import pydoc_texts

        return pydoc_texts("train")
    p = Path(path)
    if not p.is_file():
        raise LlmcError(f"--calib-data {p}: no such file; pass a plain-text or JSONL file (or omit it for the "
                        "built-in calibration text)")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise LlmcError(f"--calib-data {p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if p.suffix.lower() not in (".jsonl", ".ndjson"):
        return [raw]
    texts = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LlmcError(f"--calib-data {p}:{lineno}: not valid JSON ({exc.msg}); each line must be an "
                            'object like {"text": "..."}') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise LlmcError(f'--calib-data {p}:{lineno}: needs a "text" field holding a string; each line must be '
                            'an object like {"text": "..."}')
        texts.append(obj["text"])
    if not texts:
        raise LlmcError(f'--calib-data {p}: no lines with a "text" field; the file is empty')
    return texts


def sample_sequences(token_docs: list[list[int]], num_samples: int, seq_len: int, seed: int,
                     separator: int | None = None) -> np.ndarray:
    """``[num_samples, seq_len]`` int64 windows of the documents' concatenation (``separator`` between
    documents), at offsets drawn from ``seed``: the same inputs and seed give the same samples."""
    stream: list[int] = []
    for doc in token_docs:
        stream.extend(doc)
        if separator is not None:
            stream.append(separator)
    if len(stream) < seq_len:
        raise LlmcError(f"calibration data has {len(stream)} tokens, fewer than --calib-seq-len {seq_len}; "
                        "give more text with --calib-data or a shorter --calib-seq-len")
    tokens = np.asarray(stream, np.int64)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seq_len + 1, size=num_samples)
    return np.stack([tokens[s : s + seq_len] for s in starts])


def tokenize(tokenizer_file: Path, texts: list[str]) -> tuple[list[list[int]], int | None]:
    """Token ids of every text with the checkpoint's ``tokenizer.json``, and its end-of-text id (if any)."""
    from tokenizers import Tokenizer

    if not tokenizer_file.is_file():
        raise LlmcError(f"{tokenizer_file}: missing; calibration needs the checkpoint's tokenizer")
    tok = Tokenizer.from_file(str(tokenizer_file))
    eos = None
    cfg = tokenizer_file.with_name("tokenizer_config.json")
    if cfg.is_file():
        name = json.loads(cfg.read_text()).get("eos_token")
        eos = tok.token_to_id(name) if isinstance(name, str) else None
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)], eos


# -- statistics -------------------------------------------------------------------------------------

@dataclass
class InputStats:
    """Statistics of one linear layer's input over the calibration tokens: ``gram`` float64 ``[K, K]``
    (sum of ``x^T x``), ``abs_sum`` float64 ``[K]`` (sum of ``|x|``), ``amax`` (max ``|x|``), ``rows``."""

    gram: np.ndarray
    abs_sum: np.ndarray
    amax: float = 0.0
    rows: int = 0

    @property
    def abs_mean(self) -> np.ndarray:
        return self.abs_sum / max(self.rows, 1)

    @property
    def hessian(self) -> np.ndarray:
        """``X^T X / rows``: the (halved) Hessian of the layer's squared output error."""
        return self.gram / max(self.rows, 1)


@dataclass
class LayerStats:
    """One decoder layer (or the LM head) during calibration.

    ``linears`` maps each linear layer's parameter name (``model.layers.0.self_attn.q_proj.weight``)
    to its module; ``groups`` lists linears that read the same input tensor, in module order (Q/K/V;
    gate/up), and ``inputs`` their shared input statistics by group. ``producers`` names the norm
    weight whose module output is a group's input, when it is one (what AWQ folds scales into).
    ``kv_amax`` holds the largest key and value magnitudes (after rotary) if the layer has attention.
    """

    index: int
    prefix: str
    module: object
    linears: dict[str, object]
    groups: list[tuple[str, ...]]
    inputs: dict[tuple[str, ...], InputStats]
    producers: dict[tuple[str, ...], str] = field(default_factory=dict)
    kv_amax: tuple[float, float] | None = None
    weights_changed: bool = False

    def weight(self, name: str) -> np.ndarray:
        """float32 ``[N, K]`` weight of a linear layer (a copy)."""
        return self.linears[name].weight.detach().float().numpy().copy()

    def set_weight(self, name: str, value: np.ndarray) -> None:
        """Replace a linear layer's weight for the rest of calibration (the next layer's inputs)."""
        import torch

        self.linears[name].weight.data = torch.from_numpy(np.ascontiguousarray(value, np.float32))
        self.weights_changed = True

    def stats_of(self, name: str) -> InputStats:
        return self.inputs[next(g for g in self.groups if name in g)]


@dataclass
class _Collector:
    """Forward hooks' state for one pass over a layer."""

    names: dict[int, str]
    norm_names: dict[int, str] = field(default_factory=dict)
    pending: list[tuple[str, object]] = field(default_factory=list)
    norm_outputs: dict[int, str] = field(default_factory=dict)
    inputs: dict[tuple[str, ...], InputStats] = field(default_factory=dict)
    groups: list[tuple[str, ...]] = field(default_factory=list)
    producers: dict[tuple[str, ...], str] = field(default_factory=dict)
    _keep: list = field(default_factory=list)

    def hook(self, module, args, _output) -> None:
        self.pending.append((self.names[id(module)], args[0]))

    def norm_hook(self, module, _args, output) -> None:
        self.norm_outputs[id(output)] = self.norm_names[id(module)]
        self._keep.append(output)  # keep it alive so its id stays unique within the batch

    def flush(self) -> None:
        """Reduce the batch's recorded inputs into statistics, once per distinct input tensor."""
        import torch

        by_input: dict[int, list[str]] = {}
        tensors: dict[int, object] = {}
        for name, x in self.pending:
            by_input.setdefault(id(x), []).append(name)
            tensors[id(x)] = x
        self.pending.clear()
        norm_outputs = self.norm_outputs
        for key, names in by_input.items():
            group = tuple(names)
            if group not in self.inputs:
                self.groups.append(group)
                if key in self.norm_outputs:
                    self.producers[group] = self.norm_outputs[key]
            x = tensors[key].detach().reshape(-1, tensors[key].shape[-1]).to(torch.float64)
            stats = self.inputs.get(group)
            if stats is None:
                k = x.shape[1]
                stats = self.inputs[group] = InputStats(np.zeros((k, k)), np.zeros(k))
            stats.gram += (x.T @ x).numpy()
            stats.abs_sum += x.abs().sum(0).numpy()
            stats.amax = max(stats.amax, float(x.abs().max()))
            stats.rows += x.shape[0]
        norm_outputs.clear()
        self._keep.clear()


_kv_amax: dict[int, list[float]] = {}


def _calibration_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention that also records each layer's largest key/value magnitudes (after rotary),
    the values an FP8 KV cache must hold."""
    import torch

    seen = _kv_amax.setdefault(int(module.layer_idx), [0.0, 0.0])
    seen[0] = max(seen[0], float(key.detach().abs().max()))
    seen[1] = max(seen[1], float(value.detach().abs().max()))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


class LayerwiseCalibration:
    """Runs calibration sequences through a checkpoint's model one decoder layer at a time.

    ``param_reader(model)`` returns a function that reads one parameter of ``model`` (by its name
    in the transformers model) from the checkpoint as a numpy array; ``config`` is the model's
    transformers config. Iterate :meth:`layers` (then :meth:`head`): each yields a
    :class:`LayerStats` whose weights stay loaded until the consumer returns control.
    """

    def __init__(self, config, param_reader: Callable[[object], Callable[[str], np.ndarray]], samples: np.ndarray,
                 batch_size: int = 8) -> None:
        import torch
        from transformers import AttentionInterface, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        AttentionInterface.register(CALIB_ATTENTION, _calibration_attention)
        config = config.__class__.from_dict(config.to_dict())
        config._attn_implementation = CALIB_ATTENTION
        with no_init_weights(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Parameters are allocated but never written until a layer is loaded: no RAM is touched.
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation=CALIB_ATTENTION).eval()
        base = self.model.base_model
        for attr in ("layers", "norm", "rotary_emb"):
            if not hasattr(base, attr):
                raise UnsupportedError(f"calibration needs a decoder-only model with {type(base).__name__}.{attr} "
                                       "(Llama-style); build without AWQ/GPTQ/FP8/NVFP4 calibration")
        self.base = base
        self.read_param = param_reader(self.model)
        self.samples = torch.from_numpy(np.asarray(samples, np.int64))
        self.batch_size = batch_size
        self._names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        self._base_prefix = next(n for n, m in self.model.named_modules() if m is base) + "."
        self._release(self.model)  # nothing is resident until its layer is loaded

    def _load(self, module) -> None:
        import torch

        for p in module.parameters():
            p.data = torch.from_numpy(np.array(self.read_param(self._names[id(p)]), np.float32, copy=True))

    @staticmethod
    def _release(module) -> None:
        import torch

        for p in module.parameters():
            p.data = torch.empty(0)

    def _batches(self) -> Iterator[slice]:
        for start in range(0, len(self.samples), self.batch_size):
            yield slice(start, start + self.batch_size)

    def _run(self, fn, hidden, collector: _Collector | None):
        import torch

        outs = []
        with torch.no_grad():
            for sl in self._batches():
                outs.append(fn(hidden[sl], sl))
                if collector is not None:
                    collector.flush()
        return torch.cat(outs)

    def _stats(self, index: int, prefix: str, module, fn, hidden):
        linears = {self._names[id(m.weight)]: m for m in module.modules() if isinstance(m, _linear_type())}
        # Norm-like modules: leaves with a 1-D weight (RMSNorm, LayerNorm) whose output may feed linears.
        norms = {self._names[id(m.weight)]: m for m in module.modules()
                 if not list(m.children()) and getattr(m, "weight", None) is not None and m.weight.dim() == 1}
        collector = _Collector({id(m): n for n, m in linears.items()}, {id(m): n for n, m in norms.items()})
        handles = [m.register_forward_hook(collector.hook) for m in linears.values()]
        handles += [m.register_forward_hook(collector.norm_hook) for m in norms.values()]
        try:
            out = self._run(fn, hidden, collector)
        finally:
            for h in handles:
                h.remove()
        order = list(linears).index
        ordered = [tuple(sorted(g, key=order)) for g in collector.groups]
        inputs = {tuple(sorted(g, key=order)): s for g, s in collector.inputs.items()}
        producers = {tuple(sorted(g, key=order)): n for g, n in collector.producers.items()}
        return LayerStats(index, prefix, module, linears, ordered, inputs, producers), out

    def layers(self) -> Iterator[LayerStats]:
        """Each decoder layer in order, its weights loaded and its input statistics collected."""
        import torch

        embed = self.model.get_input_embeddings()
        self._load(embed)
        with torch.no_grad():
            hidden = torch.cat([embed(self.samples[sl]) for sl in self._batches()])
        self._release(embed)
        positions = torch.arange(self.samples.shape[1])[None]
        with torch.no_grad():
            rope = self.base.rotary_emb(hidden[:1], positions)

        for index, layer in enumerate(self.base.layers):
            self._load(layer)
            _kv_amax.clear()

            def forward(h, _sl, layer=layer):
                n = h.shape[0]
                out = layer(h, attention_mask=None, position_ids=positions.expand(n, -1),
                            position_embeddings=tuple(r.expand(n, -1, -1) for r in rope))
                return out[0] if isinstance(out, tuple) else out

            stats, out = self._stats(index, f"{self._base_prefix}layers.{index}.", layer, forward, hidden)
            kv = _kv_amax.get(getattr(layer.self_attn, "layer_idx", index)) if hasattr(layer, "self_attn") else None
            stats.kv_amax = tuple(kv) if kv else None
            yield stats
            hidden = self._run(forward, hidden, None) if stats.weights_changed else out
            self._release(layer)
        self._hidden = hidden

    def head(self) -> LayerStats:
        """The final norm and LM head (after :meth:`layers` is exhausted), with the head's input statistics."""
        norm, head = self.base.norm, self.model.get_output_embeddings()
        self._load(norm)
        self._load(head)
        module = _Pair(norm, head)
        stats, _ = self._stats(len(self.base.layers), "", module, lambda h, _sl: head(norm(h)), self._hidden)
        return stats


class _Pair:
    """The final norm and the LM head as one unit for :meth:`LayerwiseCalibration._stats`."""

    def __init__(self, norm, head) -> None:
        self.norm, self.head = norm, head

    def modules(self):
        yield from self.norm.modules()
        yield from self.head.modules()


def _linear_type():
    import torch

    return torch.nn.Linear
