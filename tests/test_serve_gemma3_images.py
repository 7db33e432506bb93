"""A Gemma 3 engine's images through `llmc serve` with the real `openai` client (issue 49 item 5): its chat
template writes ``<start_of_image>`` for an image part, the server's placeholder is that token (not the soft image
token), and the answer equals ``Engine.generate`` on the rendered conversation with the same image, streamed and
not; ``llmc run --image`` puts the same placeholder in."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
from click.testing import CliRunner

from llmc.compiler.build import BuildOptions, build
from llmc.runtime import Engine, SamplingParams
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread
from llmc.testing.vlm import random_image, write_processor, write_tiny_vlm

pytest.importorskip("torch")
BOI = 500  # <start_of_image> in the tiny config; 501 <end_of_image>, 502 the soft image token
NEW = 8
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>user\\n' if message['role'] == 'user' else '<start_of_turn>model\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("serve-gemma3")
    write_tiny_vlm("gemma3", root / "ckpt", seed=11)
    write_processor("gemma3", root / "ckpt")
    tok = train_bpe_tokenizer(vocab_size=BOI, model_max_length=512)  # ids 0..499, then the image tokens
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>", "<image_soft_token>",
                                                          "<start_of_turn>", "<end_of_turn>"]})
    assert tok.convert_tokens_to_ids("<start_of_image>") == BOI
    tok.chat_template = TEMPLATE
    save_tokenizer(tok, root / "ckpt")
    build(root / "ckpt", root / "engine", BuildOptions())
    return root / "engine", tok


def _reference(gemma3, image: bytes, text: str):
    engine_dir, tok = gemma3
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text},
                                                                    {"type": "image"}]}],
                                       add_generation_prompt=True, tokenize=False)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(BOI) == 1
    return Engine.load(engine_dir, num_threads=1).generate(
        [ids], SamplingParams(max_tokens=NEW, ignore_eos=True), images=[[image]])[0]


def test_chat_image_equals_engine_generate(gemma3):
    engine_dir, _ = gemma3
    image = random_image(np.random.default_rng(3), (50, 70))
    text = "Describe the picture."
    ref = _reference(gemma3, image, text)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    with serve_in_thread(Engine.load(engine_dir, num_threads=1), ServeConfig(model_name="g3")) as server:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="g3", messages=messages, max_tokens=NEW, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = list(client.chat.completions.create(model="g3", messages=messages, max_tokens=NEW, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True}))
    choice = out.choices[0]
    assert choice.model_extra["prompt_token_ids"] == ref.prompt_token_ids  # blank line, BOI, soft tokens, EOI ...
    assert choice.model_extra["token_ids"] == ref.token_ids
    streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids") or []]
    assert streamed == ref.token_ids


def test_llmc_run_image_puts_the_start_of_image_placeholder(gemma3, tmp_path):
    from llmc.cli.main import cli

    engine_dir, _ = gemma3
    path = tmp_path / "a.png"
    path.write_bytes(random_image(np.random.default_rng(4), (60, 60)))
    shown = CliRunner().invoke(cli, ["run", str(engine_dir), "--prompt-ids", "1,7,30", "--image", str(path),
                                     "--max-new-tokens", "4", "--json"])
    assert shown.exit_code == 0, shown.output
    prompt = json.loads(shown.output)["prompt_token_ids"]
    assert prompt[prompt.index(BOI) + 1] == 502 and prompt.count(502) == 4
