"""A byte-level BPE tokenizer trained on llmc's built-in pydoc corpus, and the chat template it carries.

The text itself (CPython 3.11.7's ``pydoc_data.topics``, pinned by sha256) is product data and lives in
:mod:`llmc.quant.corpus`, next to the calibration and accuracy code that reads it; this module is the test
support built on it.  Tests, fixtures and the default model can all be rebuilt with no network access.

This module is deliberately dependency-light (stdlib, ``tokenizers``, ``transformers``) and
importable by file path, because ``scripts/train_default_model.py`` uses it before ``llmc`` is
installed (passing the texts in, from ``quant/corpus.py`` loaded by path too).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "SPECIAL_TOKENS",
    "USER_TOKEN",
    "save_tokenizer",
    "train_bpe_tokenizer",
]

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

def train_bpe_tokenizer(vocab_size: int = 4096, model_max_length: int = 1024,
                        texts: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``, by default the training split of
    :func:`llmc.quant.corpus.pydoc_texts`.

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
    if texts is None:
        # Imported here so that a by-path load (which passes ``texts``) needs no installed llmc.
        from llmc.quant.corpus import pydoc_texts

        texts = pydoc_texts("train")
    tokenizer.train_from_iterator(texts, trainer=trainer)

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
