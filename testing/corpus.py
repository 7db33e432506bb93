"""A small, offline English corpus and a byte-level BPE tokenizer trained on it.

The corpus is the text of Python's ``pydoc_data.topics.topics`` as CPython 3.11.7 ships it,
stored next to this module (``pydoc_topics.json.gz``, pinned by :data:`CORPUS_SHA256`).  It is
shipped rather than imported from the running Python because that module differs between patch
releases (3.11.2 has 466,019 characters, 3.11.7 464,970): built-in calibration, the held-out
accuracy figures and the bundled default model's training data must not depend on which Python
runs the build.  Tests, fixtures and the default model can all be rebuilt with no network access.

This module is deliberately dependency-light (stdlib, ``tokenizers``, ``transformers``) and
importable by file path, because the test fixtures and ``scripts/train_default_model.py``
use it before ``llmc`` is installed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

try:
    from llmc.errors import LlmcError as _ErrorBase
except ImportError:  # loaded by file path (scripts/train_default_model.py) before llmc is installed
    _ErrorBase = RuntimeError

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "SPECIAL_TOKENS",
    "CORPUS_FILE",
    "CORPUS_SHA256",
    "CORPUS_SOURCE",
    "USER_TOKEN",
    "pydoc_texts",
    "save_tokenizer",
    "train_bpe_tokenizer",
]

Split = Literal["train", "heldout", "all"]

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
# The order fixes the ids: eos=0, bos=1, user=2, assistant=3.  pad reuses eos.
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

# Each turn is "<marker>\n<content><eos>\n"; system text has no marker of its own, so it is
# rendered as a user turn rather than inventing a token the model never saw.  With ``tools`` the
# template opens with a user turn listing them (llmc serve's generic tool prompt, serve/tools.py) and
# writes calls in the hermes format: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``;
# a tool's result is a user turn ``<tool_response>\n...\n</tool_response>``.  Without tools it renders
# exactly as before (the model was trained before tools were added).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|user|>\\n# Tools\\n\\nYou may call one or more functions to answer. Their signatures, one JSON "
    "object per line:\\n<tools>\\n' }}"
    "{% for tool in tools %}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\\n' }}"
    "{% endfor %}"
    "{{ '</tools>\\n\\nTo call a function, answer with one block per call:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <arguments-as-a-JSON-object>}\\n</tool_call>' + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{% for call in (message['tool_calls'] or []) %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ ('\\n' if (message['content'] or not loop.first) else '') + '<tool_call>\\n{\"name\": \"' + f['name'] "
    "+ '\", \"arguments\": ' + (f['arguments'] if f['arguments'] is string else f['arguments'] | tojson) "
    "+ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' + eos_token + '\\n' }}"
    "{% else %}"
    "{{ '<|user|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

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
                          "(the file is package data of llmc.testing)") from None
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


def train_bpe_tokenizer(vocab_size: int = 4096, model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the training split of :func:`pydoc_texts`.

    The vocabulary holds the four special tokens (ids 0-3: ``<|endoftext|>``,
    ``<|begin_of_text|>``, ``<|user|>``, ``<|assistant|>``), then the 256 byte symbols,
    then merges, so ``vocab_size`` must be at least 260.  ``bos`` is
    ``<|begin_of_text|>``; ``eos`` and ``pad`` are both ``<|endoftext|>``.

    Encoding adds no special tokens: there is no post-processor, and ``add_bos_token`` /
    ``add_eos_token`` are saved as false, so ``encode(text)`` returns exactly the tokens of
    ``text`` and decoding them gives ``text`` back byte for byte.  Callers that want a BOS
    prepend ``bos_token_id`` themselves; the chat template emits it.

    ``model_max_length`` is recorded in ``tokenizer_config.json``; it should match the
    model's ``max_position_embeddings``.

    Training is deterministic (same ``tokenizer.json`` bytes on every run) and takes well
    under a second for small vocabularies, so test fixtures can call it freely.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")

    tokenizer = Tokenizer(models.BPE())
    # No prefix space: a leading space would change the tokens of the first word and break
    # exact round trips of prompts.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(pydoc_texts("train"), trainer=trainer)

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN],
        add_bos_token=False,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (chat template inline).

    Unlike a bare ``save_pretrained``, the chat template goes into ``tokenizer_config.json``
    rather than a separate ``chat_template.jinja``, and ``tokenizer_class`` is recorded as
    ``PreTrainedTokenizerFast``, which transformers 4.x and 5.x both resolve (5.x would
    otherwise write ``TokenizersBackend``, unknown to 4.x); the extra special tokens are
    listed under ``additional_special_tokens`` for the same reason.  Returns the written
    paths.
    """
    directory = Path(directory)
    written = [str(p) for p in tokenizer.save_pretrained(directory, save_jinja_files=False)]
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # 5.x reads the older key too, while 4.x wants a dict under the newer one.
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return written
