"""Train llmc's bundled default model: a small Llama on the text of ``pydoc_data.topics``.

The result is a Hugging Face checkpoint directory (config, safetensors weights, generation
config, tokenizer with chat template) plus a ``TRAINING.md`` model card.  Everything is
seeded and the corpus ships with CPython, so the run needs no network.  The default step
count finishes in about 12 minutes on a 2-core CPU.

    python scripts/train_default_model.py                  # writes assets/default-model/
    python scripts/train_default_model.py --steps 50 --out /tmp/m   # quick smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "assets" / "default-model"
SAMPLE_PROMPT = "The for statement"
SAMPLE_TOKENS = 60
# Above this size the weights are stored as bfloat16 to keep the git asset small.
FLOAT32_LIMIT_BYTES = 17_000_000


def load_module(relative: str, name: str) -> ModuleType:
    """Load one module of the repository by path, so the script runs before llmc is installed."""
    path = REPO_ROOT / relative
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; the defaults produce the committed default model."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256, help="training context length")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100, help="heldout eval period (0: end only)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this checkpoint's weights (same shape and tokenizer) instead of random ones")
    p.add_argument("--repeat-fraction", type=float, default=0.0,
                   help="fraction of training windows that quote a passage again (teaches copying from context)")
    p.add_argument("--random-passages", type=float, default=0.0,
                   help="fraction of the quoting windows whose passage is random tokens (the clearest copying signal)")
    p.add_argument("--tile-fraction", type=float, default=0.0,
                   help="fraction of training windows that end in a random-token span repeated to the window's end "
                        "(tile_window; after the span's first copy only copying predicts a token)")
    p.add_argument("--attention-supervision", type=float, default=0.0,
                   help="weight of an auxiliary loss on the tiled windows that pulls two heads into an induction "
                        "circuit (--previous-token-head, --induction-head); 0: none")
    p.add_argument("--previous-token-head", type=_head, default=(0, 0), metavar="LAYER.HEAD",
                   help="the head that --attention-supervision teaches to attend to the previous token")
    p.add_argument("--induction-head", type=_head, default=(1, 3), metavar="LAYER.HEAD",
                   help="the head that --attention-supervision teaches to attend to the token after the current "
                        "token's earlier occurrence (later layer than --previous-token-head)")
    p.add_argument("--plant-induction", action="store_true",
                   help="start from a hand-set induction circuit (plant_induction: two layers, bigram-keyed copying "
                        "heads, rope theta 1e6, untied LM head), kept as set while the rest trains; needs --layers 2, "
                        "64 dims per head, --kv-heads equal to --heads (e.g. --hidden-size 256 --heads 4)")
    args = p.parse_args(argv)
    if args.plant_induction and (args.layers != 2 or args.kv_heads != args.heads or args.hidden_size % args.heads
                                 or induction_layout(args.hidden_size, args.heads, args.hidden_size // args.heads)
                                 is None):
        p.error(f"--plant-induction: needs --layers 2, 64 dims per head (--hidden-size / --heads), --kv-heads equal "
                f"to --heads and a width whose four token codes of (hidden - 1) // 4 dims fit the heads (256 / 4, "
                f"384 / 6); got {args.layers} layers, hidden {args.hidden_size}, {args.heads} heads, {args.kv_heads} "
                "KV heads")
    for name in ("repeat_fraction", "tile_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in [0, 1]")
    if args.attention_supervision:
        if not args.tile_fraction:
            p.error("--attention-supervision needs --tile-fraction > 0 (it supervises the tiled windows)")
        for name in ("previous_token_head", "induction_head"):
            layer, head = getattr(args, name)
            if layer >= args.layers or head >= args.heads:
                p.error(f"--{name.replace('_', '-')} {layer}.{head}: the model has {args.layers} layers of "
                        f"{args.heads} heads")
        if args.induction_head[0] <= args.previous_token_head[0]:
            p.error("--induction-head must be in a later layer than --previous-token-head (it reads that head's "
                    "output)")
    return args


def _head(text: str) -> tuple[int, int]:
    """``LAYER.HEAD`` -> (layer, head)."""
    try:
        layer, head = (int(x) for x in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER.HEAD, e.g. 1.3") from None
    return layer, head


def token_stream(texts: list[str], tokenizer: transformers.PreTrainedTokenizerBase) -> torch.Tensor:
    """Concatenate documents as ``<bos> doc <eos>`` into one flat tensor of token ids.

    Both markers are kept so the model learns where documents begin and end; random
    windows still start mid-document most of the time, so prompts without a BOS work too.
    """
    ids: list[int] = []
    for text in texts:
        ids.append(tokenizer.bos_token_id)
        # The backend call skips transformers' over-long-sequence warning; ids are identical.
        ids.extend(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def repeat_window(train: torch.Tensor, seq_len: int, sep: list[int], gen: torch.Generator, with_quote: bool = False,
                  random_vocab: int = 0) -> torch.Tensor | tuple[torch.Tensor, tuple[int, int]]:
    """A ``seq_len + 1`` window that quotes itself: passage, separator, the passage again, then onward text.

    The passage (32 to ``seq_len // 2`` tokens) is quoted from a random offset in its first half, as
    when an answer repeats a line of its prompt and goes on with what followed it (an edited function,
    a continued quotation). Real LLMs learn this copying (induction heads) from code and chat corpora,
    where passages recur; the pydoc text alone has too few repeats for a small model to learn it.
    With ``random_vocab`` the passage is random token ids below it (the special ids 0-3 excluded).
    """
    n = seq_len + 1
    length = int(torch.randint(32, seq_len // 2 + 1, (1,), generator=gen))
    start = int(torch.randint(0, train.numel() - length - n, (1,), generator=gen))
    offset = int(torch.randint(0, length // 2 + 1, (1,), generator=gen))
    passage = train[start : start + length]
    if random_vocab:  # random tokens: only copying predicts the quote, so the gradient teaches nothing else
        passage = torch.randint(4, random_vocab, (length,), generator=gen)
    onward = train[start + length : start + length + n]  # what followed the passage in the corpus
    window = torch.cat([passage, torch.tensor(sep, dtype=torch.long), passage[offset:], onward])[:n]
    if with_quote:  # also where the quote lies in the window: [start, end)
        begin = length + len(sep)
        return window, (begin, min(n, begin + length - offset))
    return window


def tile_window(train: torch.Tensor, seq_len: int, gen: torch.Generator, vocab: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``seq_len + 1`` window of text, then a random-token span repeated to the end: (window, mask, repeats).

    The span (4 to 24 tokens) starts after 0 to ``seq_len // 4`` tokens of corpus text. ``mask`` ``[seq_len]``
    is 0 on the rows that predict the span's first copy (unpredictable), 1 elsewhere; ``repeats`` ``[seq_len]``
    is True on the rows inside the repeats (where an induction head knows the next token). Dense copying data:
    induction heads form from it sooner than from natural text (where they form abruptly, after some 10M
    tokens at this batch and context size: Aoyama et al. 2025), and sooner still with :func:`induction_aux_loss`.
    """
    n = seq_len + 1
    period = int(torch.randint(4, min(24, seq_len // 2) + 1, (1,), generator=gen))
    pre = int(torch.randint(0, seq_len // 4 + 1, (1,), generator=gen))
    start = int(torch.randint(0, train.numel() - pre, (1,), generator=gen))
    span = torch.randint(4, vocab, (period,), generator=gen)
    window = torch.cat([train[start : start + pre], span.repeat(n // period + 1)])[:n]
    mask = torch.ones(seq_len)
    mask[max(pre - 1, 0) : pre + period - 1] = 0.0  # row i predicts token i + 1
    repeats = torch.zeros(seq_len, dtype=torch.bool)
    repeats[pre + period :] = True
    return window, mask, repeats


def induction_aux_loss(attentions: tuple[torch.Tensor, ...], inputs: torch.Tensor, repeats: torch.Tensor,
                       args: argparse.Namespace) -> torch.Tensor:
    """Cross-entropy of two heads' attention against an induction circuit's (``--attention-supervision``).

    The previous-token head should put its weight on the previous position (every row of every window); the
    induction head, on the rows in ``repeats`` ``[batch, seq]``, on the positions whose previous token is the
    row's own token (where the current token occurred before, plus one: any of them holds the next token).
    The language-model loss then teaches the rest (what the heads carry and copy).
    """
    layer, head = args.previous_token_head
    att = attentions[layer][:, head]  # [batch, query, key]
    rows = torch.arange(1, att.shape[1])
    loss = -torch.log(att[:, rows, rows - 1] + 1e-6).mean()
    if repeats.any():
        layer, head = args.induction_head
        att = attentions[layer][:, head]
        before = torch.cat([torch.full_like(inputs[:, :1], -1), inputs[:, :-1]], dim=1)  # key j's previous token
        causal = torch.ones(att.shape[1], att.shape[2], dtype=torch.bool).tril()
        hits = (before[:, None, :] == inputs[:, :, None]) & causal  # [batch, query, key]
        loss = loss - torch.log((att * hits).sum(-1)[repeats] + 1e-6).mean()
    return loss


PLANT_ROPE_THETA = 1e6  # rotary pairs 16-31 of a 64-dim head turn < 1e-3 rad per position: content matching


def induction_layout(hidden: int, heads: int, head_dim: int) -> tuple[int, int, int] | None:
    """(code dims, layer-0 heads, layer-1 heads) :func:`plant_induction` uses in this shape, or None if it cannot:
    the residual stream holds four token codes and a constant, layer 0 copies two codes 64 dims a head, layer 1
    matches 16 dims of each of two codes a head."""
    n_e = (hidden - 1) // 4
    h0, h1 = 2 * -(-n_e // head_dim), -(-n_e // 16)
    return (n_e, h0, h1) if head_dim == 64 and n_e >= 32 and h0 <= heads and h1 <= heads else None


@torch.no_grad()
def plant_induction(model: LlamaForCausalLM, seed: int = 0, prev_gain: float = 150.0, match_gain: float = 360.0,
                    out_gain: float = 100.0) -> dict[str, torch.Tensor]:
    """Set ``model``'s weights (2 layers, 64-dim heads, untied LM head; :func:`induction_layout`) to a two-layer
    induction circuit: the model predicts that what followed an earlier occurrence of its last two tokens
    follows again. Training then adds the language around it (the MLPs start as no-ops).

    Why planted: real LLMs learn this circuit (induction heads) from code and chat corpora after ~10M tokens;
    models trained from scratch on these 2 cores stayed on the plateau before it (docs/speculative.md), and
    prompt lookup (speculative decoding) is worth something only on a model that copies.

    Residual stream, with n = (hidden - 1) // 4: a unit-norm random code E[t] of each token in dims [0, n), a
    constant 1 in n, the previous token's code in [n + 1, 2n + 1) and the one before in [2n + 1, 3n + 1)
    (written by layer 0), the copied token's code in [3n + 1, 4n + 1) (written by layer 1); the LM head
    reads only the last.

    - Layer 0: position-only heads from the constant dimension, whose rotary phases make the score
      ``prev_gain * sum_j cos(theta_j (delta - d))`` peak at distance d = 1 or 2; each copies 64 dims of E at
      that position into its slot. Its other heads start small and random, for the text.
    - Layer 1: each head matches a 16-dim slice of (E[i], E[i-1]) against (E[j-1], E[j-2]) in the slow rotary
      pairs (``match_gain`` sets the softmax's sharpness) and copies that slice of E[j]: together the heads
      carry E of the token after the earlier occurrence of the bigram.
    - LM head: ``out_gain * E`` on the copy slot. Before any training, random-token spans are copied 99% right
      at 256 positions and 98% at 900 (hidden 256), 98% and 94% (hidden 384).

    Returns the circuit's entries per parameter name (boolean masks): training keeps them as set
    (:func:`restore_frozen`). Trained freely, 200 steps of text took the held-out quoted-passage NLL from 0.82
    to 4.9 (the model unlearned copying faster than the text taught it to use it).
    """
    cfg = model.config
    hd, d, vocab, heads = cfg.head_dim, cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    layout = induction_layout(d, heads, hd)
    if layout is None or cfg.num_hidden_layers != 2 or cfg.num_key_value_heads != heads or cfg.tie_word_embeddings:
        raise ValueError("plant_induction: needs 2 layers, 64-dim heads with as many KV heads, an untied LM head "
                         "and enough width and heads (induction_layout)")
    n_e, h0, h1 = layout
    const, prev1, prev2, out = n_e, n_e + 1, 2 * n_e + 1, 3 * n_e + 1
    gen = torch.Generator().manual_seed(seed)
    code = torch.randn(vocab, n_e, generator=gen)
    code /= code.norm(dim=1, keepdim=True)
    theta = PLANT_ROPE_THETA ** (-torch.arange(hd // 2, dtype=torch.float64) / (hd // 2))
    for name, p in model.named_parameters():
        p.fill_(1.0) if "norm" in name else p.zero_()
    model.model.embed_tokens.weight[:, :n_e] = code
    model.model.embed_tokens.weight[:, const] = 1.0
    # RMSNorm divides by the root mean square over d dims: sqrt(d / k) for k unit-norm parts
    a0 = model.model.layers[0].self_attn
    f0 = math.sqrt(d / 2)
    chunks = [(lo, min(lo + hd, n_e)) for lo in range(0, n_e, hd)]
    plan = [(dst, dist, lo, hi) for dst, dist in ((prev1, 1), (prev2, 2)) for lo, hi in chunks]
    for h, (dst, dist, lo, hi) in enumerate(plan):
        a0.q_proj.weight[h * hd: h * hd + hd // 2, const] = prev_gain / f0
        a0.k_proj.weight[h * hd: h * hd + hd // 2, const] = (torch.cos(dist * theta) / f0).float()
        a0.k_proj.weight[h * hd + hd // 2: (h + 1) * hd, const] = (torch.sin(dist * theta) / f0).float()
        for i in range(hi - lo):
            a0.v_proj.weight[h * hd + i, lo + i] = 1.0 / f0
            a0.o_proj.weight[dst + lo + i, h * hd + i] = 1.0
    free = list(range(h0 * hd, heads * hd))
    for w in (a0.q_proj.weight, a0.k_proj.weight, a0.v_proj.weight):
        w[free] = torch.randn(len(free), d, generator=gen) * 0.02
    a0.o_proj.weight[:, free] = torch.randn(d, len(free), generator=gen) * 0.02
    a1 = model.model.layers[1].self_attn
    f1 = math.sqrt(d / 4)
    slow = [j for j in range(hd // 4, hd // 2)] + [j + hd // 2 for j in range(hd // 4, hd // 2)]  # 32 dims
    bounds = [round(n_e * h / h1) for h in range(h1 + 1)]
    for h in range(h1):
        for k, e in enumerate(range(bounds[h], bounds[h + 1])):
            a1.q_proj.weight[h * hd + slow[k], e] = match_gain / f1
            a1.k_proj.weight[h * hd + slow[k], prev1 + e] = 1.0 / f1
            a1.q_proj.weight[h * hd + slow[16 + k], prev1 + e] = match_gain / f1
            a1.k_proj.weight[h * hd + slow[16 + k], prev2 + e] = 1.0 / f1
            a1.v_proj.weight[h * hd + k, e] = 1.0 / f1
            a1.o_proj.weight[out + e, h * hd + k] = 1.0
    model.lm_head.weight[:, out: out + n_e] = out_gain * code / math.sqrt(d / 5)
    for layer in model.model.layers:  # down_proj stays 0: each MLP starts as a no-op that training can grow
        layer.mlp.gate_proj.weight.normal_(0.0, 0.02, generator=gen)
        layer.mlp.up_proj.weight.normal_(0.0, 0.02, generator=gen)
    params = dict(model.named_parameters())
    frozen = {name: torch.zeros_like(params[name], dtype=torch.bool) for name in (
        "model.embed_tokens.weight", "lm_head.weight",
        *(f"model.layers.{i}.self_attn.{w}_proj.weight" for i in (0, 1) for w in "qkvo"))}
    frozen["model.embed_tokens.weight"][:, : const + 1] = True
    frozen["lm_head.weight"][:, out: out + n_e] = True
    for layer, used in ((0, h0), (1, h1)):
        for w in "qkv":
            frozen[f"model.layers.{layer}.self_attn.{w}_proj.weight"][: used * hd] = True
        frozen[f"model.layers.{layer}.self_attn.o_proj.weight"][:, : used * hd] = True
    # Layer 0's MLP stays off: what it would add to the residual stream dilutes (through RMSNorm) the codes that
    # layer 1 matches on, so that its copy heads turn soft.
    frozen["model.layers.0.mlp.down_proj.weight"] = torch.ones_like(params["model.layers.0.mlp.down_proj.weight"],
                                                                   dtype=torch.bool)
    return frozen


@torch.no_grad()
def restore_frozen(model: torch.nn.Module, frozen: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put back the entries ``frozen`` holds (name -> (mask, values)) after an optimizer step moved them."""
    params = dict(model.named_parameters())
    for name, (mask, values) in frozen.items():
        params[name][mask] = values[mask]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


@torch.no_grad()
def heldout_nll(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int) -> tuple[float, int]:
    """Mean next-token NLL over ``stream`` in non-overlapping ``seq_len`` windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, stream.numel() - 1, seq_len):
        window = stream[start : start + seq_len + 1].unsqueeze(0)
        logits = model(input_ids=window[:, :-1]).logits
        total += F.cross_entropy(logits[0].float(), window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    model.train()
    return total / count, count


@torch.no_grad()
def heldout_copy_nll(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, sep: list[int],
                     windows: int = 32) -> float:
    """Mean NLL of the quoted tokens of ``windows`` held-out :func:`repeat_window` windows (fixed seed).

    Near 0 for a model that copies from its context; near the plain held-out NLL for one that does not.
    """
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    total, count = 0.0, 0
    for _ in range(windows):
        w, quote = repeat_window(stream, seq_len, sep, gen, with_quote=True)
        logits = model(input_ids=w[None, :-1]).logits[0].float()
        nll = F.cross_entropy(logits, w[1:], reduction="none")
        total += nll[quote[0] - 1: quote[1] - 1].sum().item()  # row i predicts token i + 1
        count += quote[1] - quote[0]
    model.train()
    return total / count


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms' gains are left alone, as is standard for transformers."""
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def save_model(model: LlamaForCausalLM, out: Path) -> str:
    """Save the weights as float32 when small enough, else as bfloat16; return the dtype."""
    model.save_pretrained(out)
    dtype = "float32"
    if (out / "model.safetensors").stat().st_size >= FLOAT32_LIMIT_BYTES:
        model.to(torch.bfloat16).save_pretrained(out)
        model.to(torch.float32)
        dtype = "bfloat16"
    # transformers 5 writes rope_theta only inside rope_parameters; readers written against
    # 4.x checkpoints (Llama 3.x on the Hub) look for the top-level key.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return dtype


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate, sample and write the checkpoint plus its model card."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus = load_module("quant/corpus.py", "llmc_quant_corpus")  # the pinned pydoc text
    bpe = load_module("testing/corpus.py", "llmc_testing_corpus")  # the BPE tokenizer trained on it

    tokenizer = bpe.train_bpe_tokenizer(args.vocab_size, model_max_length=args.max_position_embeddings,
                                     texts=corpus.pydoc_texts("train"))
    train = token_stream(corpus.pydoc_texts("train"), tokenizer)
    heldout = token_stream(corpus.pydoc_texts("heldout"), tokenizer)
    print(f"tokens: train {train.numel()}, heldout {heldout.numel()}", flush=True)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=PLANT_ROPE_THETA if args.plant_induction else 10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=not args.plant_induction,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        if model.config.vocab_size != config.vocab_size or model.config.hidden_size != config.hidden_size:
            raise SystemExit(f"--init-from {args.init_from}: vocab {model.config.vocab_size} / hidden "
                             f"{model.config.hidden_size}, expected {config.vocab_size} / {config.hidden_size}; "
                             "pass the shape options the checkpoint was trained with")
        config = model.config
    else:
        model = LlamaForCausalLM(config)
    frozen = {}
    if args.plant_induction and args.init_from is None:
        params = dict(model.named_parameters())
        frozen = {n: (m, params[n].detach().clone()) for n, m in plant_induction(model, seed=args.seed).items()}
    if args.attention_supervision:  # attention weights are returned only by the eager implementation
        model.set_attn_implementation("eager")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    # A separate generator keeps batch order independent of model-init draws.
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    tokens_per_step = args.batch_size * args.seq_len
    max_start = train.numel() - args.seq_len - 1
    sep = tokenizer.backend_tokenizer.encode("\n\n", add_special_tokens=False).ids
    evals: list[tuple[int, float, float]] = []
    # Quoted passages are judged in windows of at least 256 tokens (32-128-token passages), as prompts are long.
    copy_len = max(args.seq_len, 256)
    window_loss, window_steps, loss = 0.0, 0, float("nan")
    started = last_log = time.perf_counter()
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, max_start + 1, (args.batch_size,), generator=data_gen)
        windows = [train[s : s + args.seq_len + 1] for s in starts.tolist()]
        if args.repeat_fraction:
            quoted = torch.rand(args.batch_size, generator=data_gen) < args.repeat_fraction
            rand = torch.rand(args.batch_size, generator=data_gen) < args.random_passages
            windows = [repeat_window(train, args.seq_len, sep, data_gen, random_vocab=len(tokenizer) if r else 0)
                       if q else w for w, q, r in zip(windows, quoted.tolist(), rand.tolist(), strict=True)]
        mask = repeats = None
        if args.tile_fraction:
            tiled = (torch.rand(args.batch_size, generator=data_gen) < args.tile_fraction).tolist()
            mask = torch.ones(args.batch_size, args.seq_len)
            repeats = torch.zeros(args.batch_size, args.seq_len, dtype=torch.bool)
            for i in (i for i, t in enumerate(tiled) if t):
                windows[i], mask[i], repeats[i] = tile_window(train, args.seq_len, data_gen, len(tokenizer))
        batch = torch.stack(windows)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        out = model(input_ids=batch[:, :-1], output_attentions=bool(args.attention_supervision))
        logits = out.logits
        if mask is None:
            loss_t = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        else:
            token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                         reduction="none")
            loss_t = (token_loss * mask.reshape(-1)).sum() / mask.sum()
        if args.attention_supervision:
            aux = induction_aux_loss(out.attentions, batch[:, :-1], repeats, args)
            loss_t = loss_t + args.attention_supervision * aux
        optimizer.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if frozen:  # the planted circuit stays as set; the rest learns around it
            restore_frozen(model, frozen)
        window_loss += loss_t.item()
        window_steps += 1

        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            now = time.perf_counter()
            loss = window_loss / window_steps
            rate = window_steps * tokens_per_step / (now - last_log)
            print(
                f"step {done:5d}/{args.steps}  loss {loss:.4f}  lr {lr_at(step, args):.2e}  "
                f"{rate:,.0f} tok/s  {now - started:,.0f}s",
                flush=True,
            )
            window_loss, window_steps, last_log = 0.0, 0, now
        if args.eval_every and done % args.eval_every == 0 and done != args.steps:
            nll, _ = heldout_nll(model, heldout, args.seq_len)
            evals.append((done, loss, math.exp(nll)))
            line = f"  heldout ppl {math.exp(nll):.2f} at step {done}"
            if args.repeat_fraction or args.tile_fraction:  # is it learning to copy yet?
                line += f", quoted passages nll {heldout_copy_nll(model, heldout, copy_len, sep):.3f}"
            print(line, flush=True)
            last_log = time.perf_counter()  # eval time would skew the next tok/s figure
    train_seconds = time.perf_counter() - started

    nll, n_eval = heldout_nll(model, heldout, args.seq_len)
    ppl = math.exp(nll)
    evals.append((args.steps, loss, ppl))
    print(f"heldout: {n_eval} tokens, nll {nll:.4f}, perplexity {ppl:.2f}", flush=True)
    copy_nll = heldout_copy_nll(model, heldout, copy_len, sep)
    print(f"heldout quoted passages: nll {copy_nll:.4f} (copying from context: near 0)", flush=True)

    model.eval()
    generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generation_config = generation_config
    prompt_ids = [tokenizer.bos_token_id, *tokenizer.encode(SAMPLE_PROMPT)]
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=SAMPLE_TOKENS,
        )
    sample = tokenizer.decode(generated[0, 1:].tolist(), skip_special_tokens=False)
    print(f"sample ({SAMPLE_TOKENS} greedy tokens after BOS + {SAMPLE_PROMPT!r}):\n{sample}")

    args.out.mkdir(parents=True, exist_ok=True)
    dtype = save_model(model, args.out)
    bpe.save_tokenizer(tokenizer, args.out)
    write_model_card(
        args,
        argv,
        config=config,
        n_params=n_params,
        dtype=dtype,
        train_tokens=train.numel(),
        heldout_tokens=n_eval,
        train_docs=len(corpus.pydoc_texts("train")),
        heldout_docs=len(corpus.pydoc_texts("heldout")),
        train_seconds=train_seconds,
        evals=evals,
        copy_nll=copy_nll,
        prompt_ids=prompt_ids,
        sample=sample,
    )
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()}
    print(json.dumps({"out": str(args.out), "dtype": dtype, "sizes": sizes}, indent=2))
    return 0


def write_model_card(
    args: argparse.Namespace,
    argv: list[str] | None,
    *,
    config: LlamaConfig,
    n_params: int,
    dtype: str,
    train_tokens: int,
    heldout_tokens: int,
    train_docs: int,
    heldout_docs: int,
    train_seconds: float,
    evals: list[tuple[int, float, float]],
    copy_nll: float,
    prompt_ids: list[int],
    sample: str,
) -> None:
    """Write ``TRAINING.md``: how the checkpoint was made and how good it is."""
    try:
        script = Path(__file__).resolve().relative_to(Path.cwd())
    except ValueError:
        script = Path(__file__).resolve()
    command = shlex.join(["python", str(script), *(sys.argv[1:] if argv is None else argv)])
    steps_tokens = args.steps * args.batch_size * args.seq_len
    rows = "\n".join(f"| {s} | {loss:.4f} | {p:.2f} |" for s, loss, p in evals)
    quoted = "\n".join("    " + line for line in sample.splitlines())
    origin = "trained from scratch"
    if args.init_from is not None:
        origin = f"fine-tuned from `{args.init_from}`"
    elif args.plant_induction:
        origin = ("trained from a hand-set induction circuit (`plant_induction`: it copies what followed an earlier "
                  "occurrence of its last two tokens before any training)")
    if args.repeat_fraction:
        origin += (f", with {args.repeat_fraction:.0%} of its training windows quoting a passage again "
                   "(passage, blank line, the passage from a point in its first half, then the text that "
                   f"followed it; `repeat_window`; {args.random_passages:.0%} of those passages random tokens) "
                   "so that it learns to copy from its context,")
    card = f"""# llmc default model

A tiny Llama {origin} by `scripts/train_default_model.py` on the English
text of CPython's `pydoc_data.topics.topics` (Python 3.11.7, as shipped in `testing/`). It
exists so that llmc's tests, examples and demos have a real, offline checkpoint whose
output reads like Python documentation. It is not useful for anything else.

Its size is chosen so that its fp32 weights (about 57 MB) exceed the last-level cache here: decode
speed then depends on the bytes each format reads, as it does for real models (the 4M-parameter model
before it fit in cache, and INT4 could not show its speed on it). Its step count stops near the best
held-out perplexity: trained 3x longer, it memorizes its 100K tokens (train loss 0.14, held-out
perplexity 911), and on held-out text quantization then lowers perplexity, which says nothing.

## Shape

| field | value |
|---|---|
| architecture | LlamaForCausalLM |
| parameters | {n_params:,} (embeddings tied with the LM head) |
| vocab | {config.vocab_size} (byte-level BPE, `testing/corpus.py`) |
| hidden / intermediate | {config.hidden_size} / {config.intermediate_size} |
| layers | {config.num_hidden_layers} |
| attention heads / KV heads | {config.num_attention_heads} / {config.num_key_value_heads} (GQA) |
| head dim | {config.hidden_size // config.num_attention_heads} |
| max positions / rope theta | {config.max_position_embeddings} / {config.rope_parameters["rope_theta"]} |
| rms_norm_eps | {config.rms_norm_eps} |
| weights dtype | {dtype} |

Special tokens: `<|endoftext|>` = {config.eos_token_id} (eos and pad),
`<|begin_of_text|>` = {config.bos_token_id} (bos), `<|user|>` = 2, `<|assistant|>` = 3.
The tokenizer adds no special tokens on `encode`; prepend the BOS yourself (the chat
template does). Training documents were packed as `<bos> text <eos>`.

## Training

- data: {train_tokens:,} train tokens ({train_docs} topics); heldout: every 10th topic
  by sorted key ({heldout_docs} topics, {heldout_tokens:,} tokens)
- optimizer: AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak lr {args.lr},
  {args.warmup} warmup steps, cosine to {args.min_lr_ratio} x peak, grad clip 1.0
- steps: {args.steps} x batch {args.batch_size} x {args.seq_len} tokens
  ({steps_tokens:,} tokens in all), documents packed as `<bos> text <eos>`
- seed {args.seed}, {args.threads} CPU threads, torch {torch.__version__},
  transformers {transformers.__version__}
- wall clock: {train_seconds:,.0f} s of training

| step | train loss | heldout perplexity |
|---|---|---|
{rows}

Final train loss (mean of the last {args.log_every} steps): {evals[-1][1]:.4f}.
Heldout perplexity (non-overlapping {args.seq_len}-token windows): {evals[-1][2]:.2f}.
Heldout NLL of quoted passages (32 held-out {max(args.seq_len, 256)}-token windows that quote a passage again;
near 0 for a model that copies from its context): {copy_nll:.3f}.

## Sample

Greedy, {SAMPLE_TOKENS} new tokens after BOS + `{SAMPLE_PROMPT}` (prompt ids {prompt_ids}):

{quoted}

## Reproduce

    {command}
"""
    (args.out / "TRAINING.md").write_text(card, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
