"""The built-in calibration and held-out text: the pydoc topics of CPython 3.11.7, shipped with llmc.

The corpus is the text of Python's ``pydoc_data.topics.topics`` as CPython 3.11.7 ships it, stored
in ``pydoc_topics.json.gz`` next to this module and pinned by :data:`CORPUS_SHA256`.  It is
shipped rather than imported from the running Python because that module differs between patch
releases (3.11.2 has 466,019 characters, 3.11.7 464,970): built-in calibration, the held-out
accuracy figures and the bundled default model's training data must not depend on which Python
runs the build.

This module is deliberately stdlib-only and importable by file path, because
``scripts/train_default_model.py`` (through ``testing/corpus.py``) uses it before ``llmc`` is installed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Literal

try:
    from llmc.errors import LlmcError as _ErrorBase
except ImportError:  # loaded by file path (scripts/train_default_model.py) before llmc is installed
    _ErrorBase = RuntimeError

__all__ = ["CORPUS_FILE", "CORPUS_SHA256", "CORPUS_SOURCE", "CorpusError", "Split", "pydoc_texts"]

Split = Literal["train", "heldout", "all"]

_HELDOUT_EVERY = 10

CORPUS_FILE = Path(__file__).with_name("pydoc_topics.json.gz")
# sha256 of the decompressed JSON (``{topic: text}``, sorted keys, UTF-8): what every built-in
# calibration and accuracy figure, and the default model's training data, were computed from.
CORPUS_SHA256 = "35db0d72c025200b8bcdc73ea7374eb35c056d9b955ec41524b3a5068a3095b0"
CORPUS_SOURCE = "pydoc_data.topics of CPython 3.11.7, shipped with llmc"


class CorpusError(_ErrorBase):
    """The shipped corpus file is missing or not the pinned text (a damaged or incomplete install)."""


@cache
def _topics() -> dict[str, str]:
    try:
        raw = gzip.decompress(CORPUS_FILE.read_bytes())
    except (OSError, EOFError) as exc:
        raise CorpusError(f"{CORPUS_FILE}: cannot read llmc's built-in corpus ({exc}); reinstall llmc "
                          "(the file is package data of llmc.quant)") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CORPUS_SHA256:
        raise CorpusError(f"{CORPUS_FILE}: sha256 {digest[:16]}... is not the pinned {CORPUS_SHA256[:16]}...; "
                          "the built-in corpus is damaged or was replaced: reinstall llmc")
    return json.loads(raw.decode("utf-8"))


def pydoc_texts(split: Split = "train") -> list[str]:
    """Return the documents of the shipped ``pydoc_data.topics.topics`` for one split.

    Keys are sorted, and the key at sorted index ``i`` is held out when ``i % 10 == 0``;
    the rest form the training split.  ``split="all"`` returns every document.  Documents
    come back in sorted-key order, so the result is the same on every Python.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', not {split!r}")
    topics = _topics()
    texts = []
    for index, key in enumerate(sorted(topics)):
        heldout = index % _HELDOUT_EVERY == 0
        if split == "all" or (split == "heldout") == heldout:
            texts.append(topics[key])
    return texts
