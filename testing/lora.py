"""LoRA adapters for tests and benchmarks, written by PEFT itself, and the checkpoint with one merged in.

PEFT initialises ``lora_B`` to zeros (an adapter that changes nothing); these adapters draw ``A`` and ``B`` at
random so that every adapter moves the model's output.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def write_peft_adapter(checkpoint: str | Path, out_dir: str | Path, *, r: int = 4, alpha: float = 8.0,
                       targets: tuple[str, ...] = ("q_proj", "v_proj"), rslora: bool = False, seed: int = 0,
                       std: float = 0.1, **config) -> Path:
    """Save a random LoRA adapter for ``checkpoint`` with PEFT's ``save_pretrained``; returns ``out_dir``.

    ``config``: further ``LoraConfig`` fields (``use_dora``, ``modules_to_save``, ...), for refusals."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0,
                      task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def write_merged_checkpoint(checkpoint: str | Path, adapter: str | Path, out_dir: str | Path) -> Path:
    """``checkpoint`` with ``adapter`` merged into its weights by PEFT (``merge_and_unload``), tokenizer files
    copied: the reference an adapter request's output is held to."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(out_dir)
    for f in Path(checkpoint).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(f, Path(out_dir) / f.name)
    return Path(out_dir)
