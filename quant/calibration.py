"""Calibration: token sequences from text, and activation statistics collected one decoder layer at a time.

The model's own torch definition (transformers) runs the calibration set through the network
layer by layer: only one layer's weights are in memory at a time (read from the checkpoint, then
released), the hidden states of the calibration set are the only activations kept between
layers, and each linear layer's input statistics are reduced on the fly into a Gram matrix
``X^T X``, per-channel mean magnitudes and the absolute maximum. A consumer (AWQ, GPTQ, the FP8
range collector) sees each layer's statistics while that layer's weights are loaded, may replace
its weights with quantized ones (GPTQ feeds the next layer the quantized layer's output), and
keeps only what it derives.

Nothing here knows an architecture's names. The decoder layers are the model's ``ModuleList`` of
``num_hidden_layers`` modules; what each layer is called with (rotary ``position_embeddings`` of
its layer type, the causal or sliding-window mask, GPT-2's positional cache/mask arguments) is
recorded by running the model's own forward once per batch with every layer's ``forward``
replaced by a pass-through, so the embeddings (scaled, plus learned positions, ...) and the
per-layer arguments come from transformers itself. The LM head's input is reached the same way:
the model's forward runs again with the last layer returning the calibrated hidden states, so the
model's own final norm (``norm``, ``ln_f``, ``final_layer_norm``) feeds the head.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UnsupportedError
from llmc.quant import gram as gram_ops

CALIB_ATTENTION = "llmc_calibration"


# -- data -------------------------------------------------------------------------------------------

def load_texts(path: str | Path | None) -> list[str]:
    """Documents for calibration: a JSONL file (one object with a ``"text"`` string per line), any
    other file as plain text (one document), or the training split of the built-in pydoc corpus."""
    if path is None:
        from llmc.quant.corpus import pydoc_texts

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
    """Statistics of one linear layer's input over the calibration tokens: ``gram`` float32 ``[K, K]`` (sum of
    ``x^T x``), ``abs_sum`` float64 ``[K]`` (sum of ``|x|``), ``amax`` (max ``|x|``), ``rows``."""

    gram: np.ndarray
    abs_sum: np.ndarray
    amax: float = 0.0
    rows: int = 0

    @property
    def abs_mean(self) -> np.ndarray:
        if self.rows and not self.abs_sum.size:
            raise RuntimeError("calibration collected ranges only (abs_sums=False): no mean magnitudes")
        return self.abs_sum / max(self.rows, 1)

    @property
    def hessian(self) -> np.ndarray:
        """``X^T X / rows`` in float64: the (halved) Hessian of the layer's squared output error."""
        return self.hessian_as(np.float64)

    def hessian_as(self, dtype) -> np.ndarray:
        """:attr:`hessian` computed in ``dtype`` (float32 for GPTQ, which factorises it in float32)."""
        import torch

        g = torch.from_numpy(self.gram).to(getattr(torch, np.dtype(dtype).name))
        return (g / max(self.rows, 1)).numpy()  # on every core


@dataclass
class LayerStats:
    """One decoder layer (or the LM head) during calibration.

    ``linears`` maps each linear layer's parameter name (``model.layers.0.self_attn.q_proj.weight``,
    ``transformer.h.0.attn.c_attn.weight``) to its module (``nn.Linear``, or transformers' ``Conv1D``
    whose weight is stored ``[K, N]``); ``groups`` lists linears that read the same input tensor, in
    module order (Q/K/V; gate/up), and ``inputs`` their shared input statistics by group.
    ``producers`` names the norm weight whose module output is a group's input, when it is one (what
    AWQ folds scales into). ``kv_amax`` holds the largest key and value magnitudes (after rotary) if
    the layer has attention, and ``attention_layer`` that attention's ``layer_idx`` (the graph's
    ``PagedAttention`` attribute).
    """

    index: int
    prefix: str
    module: object
    linears: dict[str, object]
    groups: list[tuple[str, ...]]
    inputs: dict[tuple[str, ...], InputStats]
    producers: dict[tuple[str, ...], str] = field(default_factory=dict)
    kv_amax: tuple[float, float] | None = None
    attention_layer: int | None = None
    weights_changed: bool = False

    def weight(self, name: str) -> np.ndarray:
        """float32 ``[N, K]`` weight of a linear layer (a copy)."""
        return self.stacked((name,))

    def stacked(self, names: tuple[str, ...]) -> np.ndarray:
        """float32 ``[sum N, K]``: the weights of linears sharing an input, one above the other (one copy)."""
        import torch

        views = [self.linears[n].weight.detach().float().cpu() for n in names]
        views = [v.T if _is_conv1d(self.linears[n]) else v for n, v in zip(names, views, strict=True)]
        return torch.cat(views).numpy()

    def set_weight(self, name: str, value: np.ndarray) -> None:
        """Replace a linear layer's weight (``[N, K]``) for the rest of calibration (the next layer's inputs)."""
        import torch

        value = np.asarray(value, np.float32)
        if _is_conv1d(self.linears[name]):
            value = value.T
        device = self.linears[name].weight.device
        self.linears[name].weight.data = torch.from_numpy(np.ascontiguousarray(value)).to(device)
        self.weights_changed = True

    def stats_of(self, name: str) -> InputStats:
        return self.inputs[next(g for g in self.groups if name in g)]


def _key(t) -> tuple:
    """Identity of a tensor's contents: views that read the same memory the same way (``h[:, 0:, :]``
    handed to the LM head after the final norm made ``h``) are the same input."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


ABS_ROWS = 256  # rows per step of the input magnitude sums


@dataclass
class _Collector:
    """Forward hooks' state for one pass over a layer."""

    names: dict[int, str]
    norm_names: dict[int, str] = field(default_factory=dict)
    pending: list[tuple[str, object]] = field(default_factory=list)
    norm_outputs: dict[tuple, str] = field(default_factory=dict)
    inputs: dict[tuple[str, ...], InputStats] = field(default_factory=dict)
    groups: list[tuple[str, ...]] = field(default_factory=list)
    producers: dict[tuple[str, ...], str] = field(default_factory=dict)
    gram_dtype: object = None  # torch dtype of the X^T X GEMMs; None: no Gram matrices (ranges only)
    abs_sums: bool = True  # the per-channel sums of |x| (AWQ's scales); False: the largest magnitude alone
    _keep: list = field(default_factory=list)
    # Sums kept where the activations are (the calibration device) until finish(): torch views of each
    # InputStats' arrays on the CPU, device tensors on a GPU.
    _sums: dict = field(default_factory=dict)

    def hook(self, module, args, _output=None) -> None:
        self.pending.append((self.names[id(module)], args[0]))

    def norm_hook(self, module, _args, output) -> None:
        if hasattr(output, "data_ptr"):
            self.norm_outputs[_key(output)] = self.norm_names[id(module)]
            self._keep.append(output)  # keep it alive so its memory is not reused within the batch

    def flush(self) -> None:
        """Reduce the batch's recorded inputs into statistics, once per distinct input tensor."""
        import torch

        by_input: dict[tuple, list[str]] = {}
        tensors: dict[tuple, object] = {}
        for name, x in self.pending:
            by_input.setdefault(_key(x), []).append(name)
            tensors[_key(x)] = x
        self.pending.clear()
        for key, names in by_input.items():
            group = tuple(dict.fromkeys(names))
            if group not in self.inputs:
                self.groups.append(group)
                if key in self.norm_outputs:
                    self.producers[group] = self.norm_outputs[key]
            # In its own dtype (a bfloat16 input under autocast): the Gram GEMM converts it once if it must, and
            # the sums below read it exactly, without a float32 copy (268 MB for a 1B down projection's batch).
            x = tensors[key].detach().reshape(-1, tensors[key].shape[-1])
            stats = self.inputs.get(group)
            if stats is None:
                k = x.shape[1]
                stats = self.inputs[group] = InputStats(np.zeros((k, k) if self.gram_dtype else (0, 0), np.float32),
                                                        np.zeros(k if self.abs_sums else 0))
                self._sums[group] = (torch.from_numpy(stats.gram).to(x.device),
                                     torch.from_numpy(stats.abs_sum).to(x.device))
            gram, abs_sum = self._sums[group]
            if self.gram_dtype is not None:
                # One batch's X^T X (a few thousand rows), summed in float32 (see gram_ops.add_upper): a 1B model's
                # down projection needs 1.1 TFLOP a layer at 32 x 256 tokens, which bfloat16 inputs (AVX-512 BF16)
                # run at 3-4x the float32 rate here; what rounding the inputs to bfloat16 does to AWQ's decisions
                # is measured in benchmarks/results/quant_calibration_ab.json.
                gram_ops.add_upper(gram, x, self.gram_dtype)
            # A few hundred rows at a time: 5-8x faster than one float64 column reduction over the batch here, and
            # the same sums (float64 adds a batch's bfloat16 / float32 magnitudes exactly but for extreme spreads).
            if self.abs_sums:
                amax = torch.zeros((), dtype=x.dtype, device=x.device)
                for r0 in range(0, x.shape[0], ABS_ROWS):
                    a = x[r0 : r0 + ABS_ROWS].abs()
                    abs_sum += a.sum(0, dtype=torch.float64)
                    amax = torch.maximum(amax, a.max())
            else:  # ranges only (FP8, NVFP4): one pass, no |x| temporaries (~30x faster than the sums here)
                lo, hi = torch.aminmax(x)
                amax = torch.maximum(hi, -lo)
            stats.amax = max(stats.amax, float(amax))
            stats.rows += x.shape[0]
        self.norm_outputs.clear()
        self._keep.clear()

    def finish(self) -> None:
        """After the last batch: fill each Gram matrix's lower triangle from its upper one (and bring the sums to
        the CPU from a GPU)."""
        import torch

        for group, stats in self.inputs.items():
            gram, abs_sum = self._sums.get(group) or (torch.from_numpy(stats.gram), None)
            if stats.gram.size:
                gram_ops.mirror_upper(gram)
            if gram.device.type != "cpu":  # on the CPU the sums were the arrays themselves
                stats.gram[...] = gram.cpu().numpy()
                stats.abs_sum[...] = abs_sum.cpu().numpy()
        self._sums.clear()


# -- attention during calibration --------------------------------------------------------------------

_kv_amax: dict[int, list[float]] = {}


def _calibration_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' own attention (SDPA with its causal / sliding-window mask; explicit when the model
    soft-caps attention logits, which SDPA cannot) that also records each layer's largest key/value
    magnitudes (after rotary), the values an FP8 KV cache must hold."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = _kv_amax.setdefault(int(getattr(module, "layer_idx", -1) or 0), [0.0, 0.0])
    seen[0] = max(seen[0], float(key.detach().abs().max()))
    seen[1] = max(seen[1], float(value.detach().abs().max()))
    softcap = kwargs.pop("softcap", None)
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    t, s = scores.shape[-2:]
    if attention_mask is None:  # SDPA's mask function leaves a plain causal mask implicit
        attention_mask = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(s - t)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :s], float("-inf"))
    else:
        scores = scores + attention_mask[..., :s]
    out = torch.softmax(scores.float(), dim=-1).to(value.dtype) @ value
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(CALIB_ATTENTION, _calibration_attention)
    # Without a registered mask function transformers builds no mask at all for a custom attention,
    # which would make sliding-window layers attend over the whole sequence. Always an explicit mask: a plain
    # causal one left implicit (None, for SDPA's is_causal) reaches families that attend inline (bloom adds
    # no mask then; mpt calls .to(bool) on it).
    def explicit_mask(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False  # create_causal_mask passes its own value
        return sdpa_mask(*args, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS.register(CALIB_ATTENTION, explicit_mask)


# -- the layer-by-layer driver -----------------------------------------------------------------------

class _Stop(Exception):
    """Ends a forward pass of the model once what is needed has been recorded."""


def _is_conv1d(module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def _linear_types() -> tuple[type, ...]:
    import torch
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, Conv1D)


def _hidden_of(args: tuple, kwargs: dict):
    return args[0] if args else kwargs["hidden_states"]


def _auto_class(config):
    """transformers' auto class the build traced ``config``'s model with (llmc.compiler.multimodal.auto_class, which
    this layer may not import): a vision-language wrapper (in the image-text-to-text mapping, its text model under
    ``text_config``) as itself, any other model as a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    image_text = config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    wrapper = image_text and isinstance(config.to_dict().get("text_config"), dict)
    only_image_text = image_text and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # Mistral 4
    return AutoModelForImageTextToText if wrapper or only_image_text else AutoModelForCausalLM


def decoder_layers(model, config) -> tuple[str, object]:
    """The model's decoder layers: the ``(name, ModuleList)`` of ``num_hidden_layers`` modules under the
    base model (``model.layers``, ``transformer.h``, ``gpt_neox.layers``)."""
    import torch

    count = getattr(config.get_text_config(), "num_hidden_layers", None)
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if any("language_model" in n for n, _ in found):  # a wrapper's text model, not its encoders' blocks
        found = [(n, m) for n, m in found if "language_model" in n]
    if found:  # the shallowest: a per-layer list of, say, experts may happen to have the same length
        depth = min(n.count(".") for n, _ in found)
        found = [(n, m) for n, m in found if n.count(".") == depth]
    if len(found) != 1:
        raise UnsupportedError(
            f"calibration: {type(model).__name__} has {len(found)} module lists of num_hidden_layers={count} "
            f"modules ({', '.join(n for n, _ in found) or 'none'}), expected exactly one (its decoder layers); "
            "build without AWQ/GPTQ/FP8/NVFP4 calibration")
    return found[0]


class LayerwiseCalibration:
    """Runs calibration sequences through a checkpoint's model one decoder layer at a time.

    ``param_reader(model)`` returns a function that reads one parameter of ``model`` (by its name
    in the transformers model) from the checkpoint as a numpy array; ``config`` is the model's
    transformers config. Iterate :meth:`layers` (then :meth:`head`): each yields a
    :class:`LayerStats` whose weights stay loaded until the consumer returns control.

    Resident weights: one decoder layer at a time, plus the modules outside the layers (embeddings,
    final norm) while the model's own forward computes the first layer's input and the head's input;
    the output projection only for the head.

    ``device``: where the forward and the statistics run (``"cpu"``, or ``"cuda"``: weights, activations and
    the sums live there; each layer's statistics come back to the CPU, where AWQ and GPTQ run).
    """

    def __init__(self, config, param_reader: Callable[[object], Callable[[str], np.ndarray]], samples: np.ndarray,
                 batch_size: int = 8, compute: str = "float32", gram: bool = True,
                 gram_compute: str | None = None, device: str = "cpu", abs_sums: bool = True) -> None:
        import torch
        from transformers.initialization import no_init_weights

        _register_attention()
        config = config.__class__.from_dict(config.to_dict())
        config._attn_implementation = CALIB_ATTENTION
        with no_init_weights(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Parameters are allocated but never written until a layer is loaded: no RAM is touched.
            # A vision-language wrapper as itself (its text forward, its parameters named as the checkpoint's)
            self.model = _auto_class(config).from_config(config, dtype=torch.float32,
                                                         attn_implementation=CALIB_ATTENTION).eval()
        self.base = self.model.base_model
        layers_name, self.blocks = decoder_layers(self.model, config)
        self._layers_prefix = layers_name + "."
        self.read_param = param_reader(self.model)
        self.device = torch.device(device)
        self.samples = torch.from_numpy(np.asarray(samples, np.int64)).to(self.device)
        self.batch_size = batch_size
        if compute not in ("float32", "bfloat16"):
            raise ValueError(f"calibration compute {compute!r}: float32 or bfloat16")
        # bfloat16: the decoder layers' linears and attention (torch autocast; norms, softmax and the residual
        # stream stay float32) and the Gram matrices run as bfloat16 GEMMs.
        self.compute = getattr(torch, compute)
        self.gram = gram
        self.abs_sums = abs_sums  # False: InputStats.abs_sum stays zero (nothing reads it: FP8, NVFP4, GPTQ)
        self.gram_dtype = getattr(torch, gram_compute or compute)
        self._names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        in_layers = {id(p) for p in self.blocks.parameters()}
        self._outside = [p for p in self.model.parameters() if id(p) not in in_layers]
        head = self.model.get_output_embeddings()
        embed = self.model.get_input_embeddings()
        self.head_module = head
        shared = {id(p) for p in embed.parameters()}
        head_only = {id(p) for p in head.parameters()} - shared
        self._before = [p for p in self._outside if id(p) not in head_only]
        # [batch][layer]: (hidden states passed positionally?, the other positional arguments, keyword arguments)
        self._layer_calls: list[list[tuple[bool, tuple, dict]]] = []
        # What a decoder layer returns, as the model's forward unpacks it: 0 = the hidden states alone, n = a tuple of
        # n (Bamba's forward unpacks (hidden_states, attn_weights) even on its Mamba layers).
        self._tuple_len = 0
        self._release(self.model)  # nothing is resident until its layer is loaded

    # -- weights

    def _load_params(self, params) -> None:
        import torch

        for p in params:
            if p.numel() == 0:
                value = torch.from_numpy(np.array(self.read_param(self._names[id(p)]), np.float32, copy=True))
                p.data = value.to(self.device)

    def _load(self, module) -> None:
        self._load_params(list(module.parameters()))

    @staticmethod
    def _release_params(params) -> None:
        import torch

        for p in params:
            p.data = torch.empty(0)

    def _release(self, module) -> None:
        self._release_params(list(module.parameters()))

    def _batches(self) -> Iterator[slice]:
        for start in range(0, len(self.samples), self.batch_size):
            yield slice(start, start + self.batch_size)

    # -- the model's own forward, with the decoder layers replaced

    def _model_pass(self, ids, layer_forward) -> None:
        """Run the model on ``ids`` with every decoder layer's forward replaced by
        ``layer_forward(index, *args, **kwargs)``, until it raises :class:`_Stop` (or the end)."""
        import torch

        for i, layer in enumerate(self.blocks):
            layer.forward = (lambda *a, _i=i, **k: layer_forward(_i, *a, **k))
        try:
            with torch.no_grad():
                self.model(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        finally:
            for layer in self.blocks:
                del layer.forward

    def _record_inputs(self):
        """The first layer's input for every sample, and every layer's other call arguments per batch."""
        import torch

        last = len(self.blocks) - 1
        hidden = []

        def record(index, *args, **kwargs):
            h = _hidden_of(args, kwargs)
            kept = {k: v for k, v in kwargs.items() if args or k != "hidden_states"}
            calls.append((bool(args), tuple(args[1:]), kept))
            if index == 0:
                hidden.append(h)
            if index == last:
                raise _Stop
            return self._as_output(h)

        self._load_params(self._before)
        for sl in self._batches():
            calls: list[tuple[bool, tuple, dict]] = []
            try:
                self._model_pass(self.samples[sl], record)
            except ValueError as exc:  # the forward unpacks a tuple from each layer: return one of that length
                m = re.match(r"(?:too many|not enough) values to unpack \(expected (\d+)", str(exc))
                if m is None or self._tuple_len == int(m.group(1)):
                    raise
                self._tuple_len = int(m.group(1))
                calls, hidden[len(self._layer_calls):] = [], []
                self._model_pass(self.samples[sl], record)
            if len(calls) != len(self.blocks) or len(hidden) != len(self._layer_calls) + 1:
                raise UnsupportedError(f"calibration: {type(self.model).__name__}'s forward called {len(calls)} of "
                                       f"its {len(self.blocks)} decoder layers; build without calibration")
            self._layer_calls.append(calls)
        self._release_params(self._before)
        return torch.cat(hidden)

    def _as_output(self, h):
        """``h`` as a decoder layer returns it (a tuple with ``h`` first where the layers return tuples)."""
        return (h, *[None] * (self._tuple_len - 1)) if self._tuple_len else h

    def _run(self, fn, hidden, collector: _Collector | None):
        import torch

        outs = []
        with torch.no_grad():
            for b, sl in enumerate(self._batches()):
                out = fn(hidden[sl], b, sl)
                if out is not None:
                    outs.append(out)
                if collector is not None:
                    collector.flush()
        return torch.cat(outs) if outs else None

    def _stats(self, index: int, prefix: str, module, modules: list, fn, hidden, head=None):
        linear_types = _linear_types()
        linears = {self._names[id(m.weight)]: m for m in modules if isinstance(m, linear_types)}
        # Norm-like modules: leaves with a 1-D weight (RMSNorm, LayerNorm) whose output may feed linears.
        norms = {self._names[id(m.weight)]: m for m in modules
                 if not list(m.children()) and isinstance(getattr(m, "weight", None), _parameter_type())
                 and m.weight.dim() == 1}
        collector = _Collector({id(m): n for n, m in linears.items()}, {id(m): n for n, m in norms.items()},
                               gram_dtype=self.gram_dtype if self.gram else None, abs_sums=self.abs_sums)
        handles = [m.register_forward_hook(collector.hook) for m in linears.values() if m is not head]
        handles += [m.register_forward_hook(collector.norm_hook) for m in norms.values()]
        if head is not None:  # record the head's input, then stop: the logits themselves are not needed
            def stop_at_head(m, args):
                collector.hook(m, args)
                raise _Stop

            handles.append(head.register_forward_pre_hook(stop_at_head))
        try:
            out = self._run(fn, hidden, collector)
        finally:
            for h in handles:
                h.remove()
        collector.finish()
        order = list(linears).index
        ordered = [tuple(sorted(g, key=order)) for g in collector.groups]
        inputs = {tuple(sorted(g, key=order)): s for g, s in collector.inputs.items()}
        producers = {tuple(sorted(g, key=order)): n for g, n in collector.producers.items()}
        return LayerStats(index, prefix, module, linears, ordered, inputs, producers), out

    def layers(self) -> Iterator[LayerStats]:
        """Each decoder layer in order, its weights loaded and its input statistics collected."""
        import torch

        hidden = self._record_inputs()
        for index, layer in enumerate(self.blocks):
            self._load(layer)
            _kv_amax.clear()

            def forward(h, b, _sl, layer=layer, index=index):
                positional, rest, kw = self._layer_calls[b][index]
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.compute == torch.bfloat16):
                    out = layer(h, *rest, **kw) if positional else layer(*rest, **kw, hidden_states=h)
                if isinstance(out, tuple):
                    self._tuple_len = len(out)
                    out = out[0]
                return out.float()

            stats, out = self._stats(index, f"{self._layers_prefix}{index}.", layer, list(layer.modules()), forward,
                                     hidden)
            if len(_kv_amax) == 1:
                (stats.attention_layer, kv), = _kv_amax.items()
                stats.kv_amax = tuple(kv)
            yield stats
            hidden = self._run(forward, hidden, None) if stats.weights_changed else out
            self._release(layer)
        self._hidden = hidden
        self._layer_calls = []

    def head(self) -> LayerStats:
        """The LM head (after :meth:`layers` is exhausted), with its input statistics: the model's own
        forward runs from the calibrated last hidden states through its final norm to the head."""
        last = len(self.blocks) - 1
        hidden, batch = self._hidden, {}

        def inject(index, *args, **kwargs):
            h = hidden[batch["slice"]] if index == last else _hidden_of(args, kwargs)
            return self._as_output(h)

        def fn(_h, _b, sl):
            batch["slice"] = sl
            self._model_pass(self.samples[sl], inject)

        self._load_params(self._outside)
        in_layers = {id(m) for m in self.blocks.modules()}
        modules = [m for m in self.model.modules() if id(m) not in in_layers and m is not self.model]
        linear_types = _linear_types()
        modules = [m for m in modules if m is self.head_module or not isinstance(m, linear_types)]
        stats, _ = self._stats(len(self.blocks), "", self.head_module, modules, fn, hidden, head=self.head_module)
        return stats

    def release_head(self) -> None:
        """Free the modules outside the decoder layers after :meth:`head`'s consumer is done."""
        self._release_params(self._outside)


def _parameter_type():
    import torch

    return torch.nn.Parameter
