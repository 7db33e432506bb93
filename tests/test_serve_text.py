"""Stream deltas never split a UTF-8 character or leak a stop string; logprob tokens carry their exact bytes;
chat templates render as transformers renders them. Real tokenizers from the test engines, no server."""

from __future__ import annotations

import pytest

from llmc.runtime.tokenizer import Tokenizer
from llmc.serve.chat import ChatTemplate
from llmc.serve.text import TextStream, TokenStrings

TEXT = "naïve café: 世界 🙂 ok — ∑x"


@pytest.fixture(scope="module")
def tok(tiny_engine) -> Tokenizer:
    return Tokenizer(tiny_engine)


def test_deltas_never_split_a_character(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    partial = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert partial, "the text must contain characters split over tokens, or this test proves nothing"
    stream = TextStream(tok, [])
    deltas = [stream.add([t]) for t in ids]
    deltas.append(stream.finish(tok.decode(ids)))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TEXT


def test_stop_string_is_held_back_until_the_end(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop = "世界 🙂"
    stream = TextStream(tok, [stop, "zz"])
    shown = ""
    for i, t in enumerate(ids):
        full = tok.decode(ids[: i + 1])
        if stop in full:  # this token completes the stop string: the engine finishes with the text cut before it
            final = full[: full.index(stop)]
            assert shown + stream.finish(final) == final == "naïve café: "
            return
        shown += stream.add([t])
        assert full.startswith(shown)
        # never more than the text minus what could be the start of the longest stop string
        assert len(shown) <= max(0, len(full.rstrip("\ufffd")) - (len(stop) - 1))
    raise AssertionError("the stop string was never completed")


def test_token_bytes_reassemble_the_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    strings = TokenStrings(tok)
    assert b"".join(bytes(strings.get(t)[1]) for t in ids) == TEXT.encode()
    assert any("\ufffd" in strings.get(t)[0] for t in ids)  # some token is part of a character


def test_chat_template_renders_like_transformers(tiny_engine, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_engine))
    template = ChatTemplate.from_engine(tiny_engine, tok.config)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a for loop?"},
                {"role": "assistant", "content": "A loop."}, {"role": "user", "content": "ünïcode"}]
    for gen in (True, False):
        assert template.render(messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, add_generation_prompt=gen, tokenize=False)


def test_incremental_deltas_equal_the_full_decode_on_random_token_streams(tok):
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 512, size=200).tolist()  # byte tokens included: broken characters on purpose
        full = tok.decode(ids)
        stream = TextStream(tok, [])
        streamed = "".join(stream.add([t]) for t in ids)
        assert full.startswith(streamed) and len(streamed) >= len(full) - 4  # all but a trailing partial char
        assert streamed + stream.finish(full) == full


def test_sse_event_is_one_line_for_every_splitter():
    import json

    from llmc.serve.generate import sse_event

    text = "a\u2028b\u2029c\x85d\x1ce\n\r\"é世🙂"
    raw = sse_event({"choices": [{"text": text}]})
    assert raw.endswith(b"\n\n") and raw.startswith(b"data: ")
    line = raw[:-2].decode()
    assert line.splitlines() == [line]  # httpx's iter_lines splits as str.splitlines does
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text
    assert "é世🙂" in line  # UTF-8 stays UTF-8 (no \\u escapes for ordinary text)
