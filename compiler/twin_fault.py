"""Whose fault it is when transformers cannot run the self-check's twin (compiler/selfcheck.py).

The twin is the user's config shrunk. When transformers' own classes fail on it (building the model, or its
forward), either transformers rejects the user's config itself (e.g. Qwen3.5 with only linear-attention layers:
its cache has no attention layer to size the mask from) — one line naming transformers' failure, exit 2 — or
llmc's shrinking broke a relation the family's modules assume — llmc's bug, an internal error naming the twin
(exit 70). The user's own sizes are tried on the meta device (no memory, no arithmetic), cut to the twin's layers:
the same failure there is the config's.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from llmc.errors import LlmcError

# Words of a failure that only the meta device causes (values read from tensors that have none): no verdict.
_META_ONLY = re.compile(r"meta tensor|on the meta device|\.item\(\)|data-dependent|Cannot copy out of meta", re.I)
# Failures about the mix of layer kinds name the config's per-layer list.
_LAYER_KIND_WORDS = ("Attention layers", "LinearAttention", "layer type", "layer_types")


class TransformersFailed(Exception):
    """transformers' own code raised ``cause`` while the self-check ran its ``stage`` on the twin."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"{stage}: {type(cause).__name__}: {cause}")
        self.stage, self.cause = stage, cause


class TwinBug(RuntimeError):
    """llmc shrank a config transformers runs into a twin transformers cannot run: llmc's bug (exit 70)."""


def in_transformers(stage: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a call into transformers; its failure raised as :class:`TransformersFailed`."""
    try:
        return fn(*args, **kwargs)
    except (OSError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - judged by blame(): the config's fault or llmc's
        raise TransformersFailed(stage, exc) from exc


def one_line(exc: BaseException, limit: int = 300) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def config_field(message: str, config: dict) -> str | None:
    """The config field transformers' ``message`` is about, where it can be told: a field it names, else the
    per-layer list where it speaks of the mix of layer kinds."""
    named = [k for k in config if isinstance(k, str) and len(k) > 3 and re.search(rf"\b{re.escape(k)}\b", message)]
    if named:
        return max(named, key=len)
    if any(w in message for w in _LAYER_KIND_WORDS) and isinstance(config.get("layer_types"), list):
        return "layer_types"
    return None


def run_on_meta(config: dict, stage: str) -> BaseException | None:
    """Build ``config``'s model on the meta device and, for the ``forward`` stage, run a 5-token forward; the
    exception transformers raised, or None."""
    import torch
    from transformers import AutoConfig

    from llmc.compiler.multimodal import auto_class

    try:
        with tempfile.TemporaryDirectory(prefix="llmc-twin-fault-") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
            cfg = AutoConfig.from_pretrained(tmp)
        with torch.device("meta"):
            model = auto_class(config).from_config(cfg, dtype=torch.float32).eval()
            if stage == "forward":
                with torch.no_grad():
                    model(torch.ones((1, 5), dtype=torch.long))
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - the verdict is what it raised
        return exc
    return None


def blame(failed: TransformersFailed, config: dict, cut: dict, twin: dict, model_type: str) -> Exception:
    """The error to raise for ``failed``: :class:`LlmcError` (exit 2) where the user's sizes (``cut``: ``config`` cut
    to the twin's layers) fail the same way, else :class:`TwinBug`."""
    import transformers

    said = one_line(failed.cause)
    on_meta = run_on_meta(cut, failed.stage)
    if on_meta is not None and not _META_ONLY.search(str(on_meta)):
        field = config_field(str(on_meta), config) or config_field(str(failed.cause), config)
        about = f" (config field {field!r})" if field else ""
        verb = "forward raises" if failed.stage == "forward" else "model classes raise"
        return LlmcError(
            f"transformers {transformers.__version__} itself cannot run this {model_type} config{about}: its {verb} "
            f"{one_line(on_meta)}; llmc builds what transformers runs, so fix the config (or use one transformers "
            "accepts)")
    return TwinBug(
        f"llmc's self-check shrank this {model_type} config into a twin transformers {transformers.__version__} cannot "
        f"run ({failed.stage}: {said}), though it runs the config's own sizes: llmc's bug, please report it with "
        f"the twin {json.dumps(twin, sort_keys=True, default=str)[:1500]}")
