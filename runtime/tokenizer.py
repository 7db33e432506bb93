"""Tokenizer glue over the `tokenizers` library (the runtime imports no transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from llmc.errors import LlmcError


class Tokenizer:
    """Encodes prompts and decodes outputs exactly as the checkpoint's ``tokenizer.json`` defines."""

    def __init__(self, engine_dir: Path) -> None:
        path = engine_dir / "tokenizer.json"
        if not path.is_file():
            raise LlmcError(f"{path}: missing; text prompts need a tokenizer (pass token ids instead)")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = engine_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A rendered chat template already holds its special tokens: pass add_special_tokens=False.
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def id_to_token(self, token_id: int) -> str | None:
        """The token's string in the vocabulary (byte-level BPE: its bytes mapped to printable characters)."""
        return self._tok.id_to_token(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
