"""Images through `llmc serve` (issue 49 item 5), with the real `openai` client on 127.0.0.1: a tiny LLaVA engine
(vision encoder built in, a tokenizer whose ``<image>`` is the model's image token, a chat template that places
image parts) answers a data-URL PNG in chat completions, streamed and not, and in /v1/responses ``input_image``,
with the same greedy tokens as ``Engine.generate`` on that image; every bad image is a 400 naming it, and the
server answers the next good request."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import numpy as np
import openai
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.runtime import Engine, SamplingParams
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread
from llmc.testing.vlm import random_image, write_processor, write_tiny_vlm

pytest.importorskip("torch")
MODEL = "llava"
IMAGE = 502  # the tiny checkpoint's image token
NEW = 8
# transformers' multimodal templates loop over a message's parts; an image part becomes the image token's text.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|user|>\\n' if message['role'] == 'user' else '<|assistant|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _tokenizer(out):
    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer(vocab_size=IMAGE, model_max_length=512)  # ids 0..501, then <image> = 502
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == IMAGE
    tok.chat_template = TEMPLATE
    save_tokenizer(tok, out)
    return tok


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-llava")
    write_tiny_vlm("llava", root / "ckpt", seed=5)
    write_processor("llava", root / "ckpt")
    tok = _tokenizer(root / "ckpt")
    build(root / "ckpt", root / "engine", BuildOptions())
    media = root / "media"
    media.mkdir()
    return root / "engine", tok, media


@pytest.fixture(scope="module")
def server(llava):
    engine_dir, _, media = llava
    config = ServeConfig(model_name=MODEL, allowed_local_media_path=str(media))
    with serve_in_thread(Engine.load(engine_dir, num_threads=1), config) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llava) -> Engine:
    return Engine.load(llava[0], num_threads=1)


def _png(seed: int = 0) -> bytes:
    return random_image(np.random.default_rng(seed), (40, 56))


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _messages(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]


def _reference(llava, offline, image: bytes, text: str = "What is in this picture?", ignore_eos: bool = True):
    """Engine.generate on the conversation as transformers renders it, with the same image."""
    _, tok, _ = llava
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text},
                                                                    {"type": "image"}]}],
                                       add_generation_prompt=True, tokenize=False)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(IMAGE) == 1
    return offline.generate([ids], SamplingParams(max_tokens=NEW, ignore_eos=ignore_eos), images=[[image]])[0]


def test_chat_image_equals_engine_generate_streamed_and_not(client, llava, offline):
    image = _png(1)
    ref = _reference(llava, offline, image)
    out = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(image)), max_tokens=NEW,
                                         temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == ref.token_ids and choice.message.content == ref.text
    assert choice.model_extra["prompt_token_ids"] == ref.prompt_token_ids  # the image's 16 tokens in place
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=_messages(_data_url(image)), max_tokens=NEW,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True}))
    streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids") or []]
    assert streamed == ref.token_ids
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == ref.text


def test_the_encoder_never_runs_on_the_step_loop(server, client):
    """Images are encoded on a worker thread before the step loop sees the request: an encode (seconds for a real
    encoder) never holds up the steps of the requests already running."""
    encoder = server.state.engine.images
    before = encoder.encoded
    out = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(_png(7))), max_tokens=2,
                                         temperature=0)
    assert out.choices[0].message.content is not None
    assert encoder.encoded == before + 1  # this image was new: it ran the encoder once
    assert encoder.encode_threads and "llmc-step-loop" not in encoder.encode_threads


def test_another_image_answers_as_the_engine_does(client, llava, offline):
    image = _png(2)
    ref = _reference(llava, offline, image)
    out = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(image)), max_tokens=NEW,
                                         temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids


def test_responses_input_image(client, llava, offline):
    image = _png(3)
    ref = _reference(llava, offline, image, "Describe it.", ignore_eos=False)
    resp = client.responses.create(model=MODEL, max_output_tokens=NEW, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Describe it."},
                                     {"type": "input_image", "image_url": _data_url(image), "detail": "auto"}]}])
    assert resp.output_text == ref.text
    assert resp.usage.input_tokens == len(ref.prompt_token_ids)


def test_local_file_under_the_allowed_directory(client, llava, offline):
    _, _, media = llava
    image = _png(4)
    (media / "cat.png").write_bytes(image)
    ref = _reference(llava, offline, image)
    for url in (f"file://{media / 'cat.png'}", "cat.png"):
        out = client.chat.completions.create(model=MODEL, messages=_messages(url), max_tokens=NEW, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == ref.token_ids


def _bomb() -> bytes:
    """A tiny PNG whose header claims 100000 x 100000 pixels."""
    buf = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", 100_000, 100_000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _ppm() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PPM")
    return buf.getvalue()


BAD = [  # (what, messages, param, words of the message)
    ("not an image", _messages(_data_url(b"hello, this is text")), "messages[0].content[1]", "not an image"),
    ("truncated", _messages(_data_url(_png(5)[:300])), "messages[0].content[1]", "truncated"),
    ("decompression bomb", _messages(_data_url(_bomb())), "messages[0].content[1]", "decompression bomb"),
    ("unsupported format", _messages(_data_url(_ppm(), "image/x-portable-pixmap")), "messages[0].content[1]",
     "unsupported image format PPM"),
    ("bad base64", _messages("data:image/png;base64,@@not base64@@"), "messages[0].content[1]", "invalid base64"),
    ("not an image type", _messages("data:text/plain;base64,aGk="), "messages[0].content[1]", "not an image"),
    ("too many", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(_png(6))}}] * 5}],
     "messages", "--max-images-per-request"),
    ("remote", _messages("https://example.com/cat.png"), "messages[0].content[1]", "--allow-remote-images"),
    ("outside the media dir", _messages("file:///etc/hostname"), "messages[0].content[1]",
     "--allowed-local-media-path"),
    ("image token in the text", _messages(_data_url(_png(7)), "two <image> here"), "messages", "2 image tokens"),
]


@pytest.mark.parametrize("what,messages,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_image_is_a_400_and_the_server_keeps_serving(client, what, messages, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param and words in body["message"], body
    ok = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(_png(8))), max_tokens=2,
                                        extra_body={"ignore_eos": True})
    assert ok.choices[0].finish_reason == "length"


def test_bad_input_image_in_responses_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": _data_url(b"nope")}]}])
    assert "not an image" in err.value.body["message"] and err.value.body["param"].startswith("input[0]")
    assert client.responses.create(model=MODEL, max_output_tokens=2, input="hello").status in ("completed",
                                                                                                "incomplete")


def test_image_to_a_text_only_engine_is_a_400(tiny_engine):
    with serve_in_thread(Engine.load(tiny_engine, num_threads=1), ServeConfig(model_name="tiny")) as s:
        c = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="tiny", messages=_messages(_data_url(_png(9))), max_tokens=2)
        assert err.value.body["param"] == "messages[0].content[1]" and "takes no images" in err.value.body["message"]
        ok = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert ok.choices[0].message.content is not None


def _llmc(*args) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from llmc.cli.main import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_llmc_run_image_equals_engine_generate(llava, offline, tmp_path):
    engine_dir, tok, _ = llava
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(_png(10))
    b.write_bytes(_png(11))
    code, out, err = _llmc("run", engine_dir, "--image", a, "--image", b, "--prompt", "Compare them:", "-n", NEW,
                           "--ignore-eos", "--json")
    assert code == 0, err
    got = json.loads(out)
    ids = tok("<image><image>Compare them:", add_special_tokens=True)["input_ids"]
    ref = offline.generate([ids], SamplingParams(max_tokens=NEW, ignore_eos=True), images=[[a, b]])[0]
    assert got["token_ids"] == ref.token_ids and got["prompt_token_ids"] == ref.prompt_token_ids


def test_llmc_run_image_on_a_text_engine_is_one_line(tiny_engine, tmp_path):
    (tmp_path / "a.png").write_bytes(_png(12))
    code, _, err = _llmc("run", tiny_engine, "--image", tmp_path / "a.png", "--prompt", "hi", "-n", 2)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "takes no images" in lines[0], err


def test_template_without_image_parts_gets_the_image_token_text(server, client, llava, offline):
    """A chat template that only takes string content: the image token's text stands where the part was."""
    from llmc.serve.chat import ChatTemplate
    from llmc.testing.corpus import CHAT_TEMPLATE

    _, tok, _ = llava
    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    image = _png(13)
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "What is in this picture?<image>"}],
                                      chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    ref = offline.generate([ids], SamplingParams(max_tokens=NEW, ignore_eos=True), images=[[image]])[0]
    kept, server.state.chat_template = server.state.chat_template, ChatTemplate(CHAT_TEMPLATE, special)
    try:
        assert not server.state.chat_template.takes_images
        out = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(image)), max_tokens=NEW,
                                             temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    finally:
        server.state.chat_template = kept
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids


def test_llmc_bench_image_reports_encoder_and_ttft(llava, tmp_path):
    (tmp_path / "a.png").write_bytes(_png(14))
    code, out, err = _llmc("bench", llava[0], "--image", tmp_path / "a.png", "--workloads", "prefill",
                           "--prefill-len", 8, "--input-len", 8, "--repeats", 1, "--warmup", 0, "--threads", 1,
                           "--json", "-q")
    assert code == 0, err
    row = next(r for r in json.loads(out)["rows"] if r["workload"] == "image")
    assert row["image_tokens"] == 16 and row["image_hw"] == [40, 56]
    assert row["encoder_ms"] > 0 and row["ttft_ms"] > 0 and row["ttft_text_only_ms"] > 0
