"""Every malformed request gets a 4xx with the OpenAI error object naming the field, and the server goes on serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from llmc.runtime import Engine
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread

MODEL = "tiny"
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1, kv_cache_tokens=4096)
    config = ServeConfig(model_name=MODEL, api_key=KEY, max_body_size=64 << 10, max_n=4)
    with serve_in_thread(engine, config) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def _good(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "The", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _check(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


GOOD = {"model": MODEL, "prompt": "The", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (path, body, status, param, words in the message)
CASES = [
    ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", ["greater than or equal to 1"]),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", ["greater than or equal to 1"]),
    ("/v1/completions", {**GOOD, "max_tokens": 10**12}, 400, "max_tokens", ["context of 512"]),
    ("/v1/completions", {**GOOD, "max_tokens": "16"}, 400, "max_tokens", ["valid integer"]),
    ("/v1/completions", {**GOOD, "max_tokens": 1.5}, 400, "max_tokens", ["valid integer"]),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", ["valid number"]),
    ("/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature", ["less than or equal to 2"]),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", ["greater than 0"]),
    ("/v1/completions", {**GOOD, "presence_penalty": 5}, 400, "presence_penalty", ["less than or equal to 2"]),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream", ["valid boolean"]),
    ("/v1/completions", {**GOOD, "stop": 7}, 400, "stop", ["string or an array of strings"]),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop", ["non-empty"]),
    ("/v1/completions", {**GOOD, "stop_token_ids": [100000]}, 400, "stop_token_ids", ["outside the vocabulary"]),
    ("/v1/completions", {**GOOD, "seed": "x"}, 400, "seed", ["valid integer"]),
    ("/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs", ["less than or equal to 20"]),
    ("/v1/completions", {**GOOD, "n": 5}, 400, "n", ["at most 4"]),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n", ["greater than or equal to 1"]),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": "y"}}, 400, "stream_options.include_usage",
     ["valid boolean"]),
    ("/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt", ["must be a string"]),
    ("/v1/completions", {**GOOD, "prompt": [1, "a"]}, 400, "prompt", ["must be a string"]),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt", ["empty"]),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt", ["empty"]),
    ("/v1/completions", {**GOOD, "prompt": [5, 512]}, 400, "prompt", ["token id 512", "0..511"]),
    ("/v1/completions", {**GOOD, "prompt": [-1]}, 400, "prompt", ["token id -1"]),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], [3, 99999]]}, 400, "prompt", ["prompt[1]", "99999"]),
    ("/v1/completions", {**GOOD, "prompt": [7] * 600}, 400, "prompt", ["600 tokens", "context is 512"]),
    ("/v1/completions", {**GOOD, "prompt": [7] * 500, "max_tokens": 100}, 400, "max_tokens",
     ["500 prompt + 100", "at most 12"]),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", ["required"]),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", ["'gpt-4' is not served", "'tiny'"]),
    ("/v1/completions", {**GOOD, "return_token_ids": 1}, 400, "return_token_ids", ["boolean"]),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", ["at least 1"]),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages", ["valid list"]),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, 400, "messages[0].role", ["missing"]),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content",
     ["string or an array of content parts"]),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", ["needs logprobs=true"]),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**9}, 400, "max_completion_tokens",
     ["context of 512"]),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x " * 2000}]}, 400, "messages",
     ["context is 512"]),
    ("/v1/chat/completions", {**CHAT, "model": "other"}, 404, "model", ["not served"]),
    ("/v1/completions", {**GOOD, "echo": True}, 400, "echo", ["not supported"]),
    ("/v1/completions", {**GOOD, "suffix": "x"}, 400, "suffix", ["not supported"]),
    ("/v1/completions", {**GOOD, "best_of": 3}, 400, "best_of", ["use n"]),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": 100}}, 400, "logit_bias", ["not supported"]),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format",
     ["'xml' is not one of"]),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400,
     "response_format", ["response_format.json_schema.schema", "strin"]),
    ("/v1/completions", {**GOOD, "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs",
     ["structured_outputs.regex", "unclosed group"]),
    ("/v1/completions", {**GOOD, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs",
     ["exactly one of"]),
    ("/v1/completions", {**GOOD, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     400, "structured_outputs", ["not both"]),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice",
     ["'g' is not one of the tools"]),
    ("/v1/chat/completions", {**CHAT, "tools": []}, 400, "tools", ["too short"]),
    ("/v1/completions", {**GOOD, "prompt": [[5]] * 600}, 400, "prompt", ["600 choices", "--max-queue"]),
    ("/detokenize", {"tokens": [1, 4096]}, 400, "tokens", ["outside the vocabulary"]),
    ("/tokenize", {}, 400, "prompt", ["exactly one of prompt or messages"]),
]


@pytest.mark.parametrize("path,body,status,param,words", CASES, ids=[f"{c[0]}:{c[3]}:{i}" for i, c in enumerate(CASES)])
def test_bad_field_gets_a_4xx_naming_it(http, path, body, status, param, words):
    _check(http.post(path, json=body), status, param, *words)
    _good(http)


def test_invalid_json_and_invalid_utf8_and_non_object(http):
    h = {**AUTH, "Content-Type": "application/json"}
    _check(http.post("/v1/completions", content=b'{"prompt": "a", ', headers=h), 400, None, "invalid JSON", "line 1")
    _check(http.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=h), 400, None, "not valid UTF-8",
           "byte 12")
    _check(http.post("/v1/completions", content=b"[1, 2]", headers=h), 400, None, "must be a JSON object")
    _check(http.post("/v1/chat/completions", content=b"", headers=h), 400, None, "invalid JSON")
    _good(http)


def test_body_over_the_limit_is_413_declared_or_streamed(http):
    big = {**GOOD, "prompt": "a" * (70 << 10)}
    _check(http.post("/v1/completions", json=big), 413, None, "limit is 65536", "--max-body-size")

    def chunks():  # no Content-Length: the server counts as it reads
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"a" * 1024
        yield b'"}'

    _check(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413, None,
           "over 65536 bytes")
    _good(http)


def test_api_key_missing_or_wrong_is_401_and_open_paths_stay_open(server, http):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            err = _check(anon.post(path, json=GOOD), 401, None, "missing API key")
            assert err["code"] == "invalid_api_key"
        _check(anon.get("/v1/models"), 401, None, "missing API key")
        _check(anon.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer sk-test-0123456780"}), 401,
               None, "incorrect API key")
        _check(anon.post("/v1/completions", json=GOOD, headers={"Authorization": KEY}), 401, None, "incorrect")
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no key
            assert anon.get(path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).completions.create(model=MODEL, prompt="a")
    _good(http)


def test_unknown_path_and_method_use_the_error_object(http):
    _check(http.get("/v1/nothing"), 404, None, "/v1/nothing")
    _check(http.get("/v1/completions"), 405, None)
    _good(http)


def test_openai_client_raises_bad_request_with_the_message(server):
    c = openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens") as e:
        c.completions.create(model=MODEL, prompt="a", max_tokens=100000)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError, match="not served"):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert c.completions.create(model=MODEL, prompt="a", max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_chat_without_a_template_is_a_clear_400(tmp_path, tiny_engine):
    import json
    import shutil

    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine_dir)
    cfg = json.loads((engine_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (engine_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = Engine.load(engine_dir, num_threads=1, verify=False)  # the edited file no longer matches its sha256
    with serve_in_thread(engine, ServeConfig(model_name=MODEL)) as s:
        r = httpx.post(s.v1 + "/chat/completions", json=CHAT)
        err = _check(r, 400, "messages", "has no chat template", "/v1/completions")
        assert err["code"] == "no_chat_template"
        assert httpx.post(s.v1 + "/completions", json=GOOD).status_code == 200


def test_template_that_raises_is_a_400(server, http):
    # The tiny model's template renders any role; a template's own raise_exception becomes the message.
    from llmc.serve.chat import ChatTemplate
    from llmc.serve.errors import APIError

    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}",
                     {})
    with pytest.raises(APIError, match="first must be user"):
        t.render([{"role": "assistant", "content": "x"}])
    broken = ChatTemplate("{% for m in messages %}{{ m['content'] }", {})
    assert broken.error and "line 1" in broken.error
    with pytest.raises(APIError, match="does not compile"):
        broken.render([{"role": "user", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(APIError, match="unsafe"):
        sandboxed.render([{"role": "user", "content": "x"}])
    _good(http)


def test_unknown_fields_are_ignored_as_openai_does(http):
    r = http.post("/v1/completions", json={**GOOD, "user": "u-1", "frobnicate": {"x": [1]}, "best_of": 1,
                                           "echo": False, "logit_bias": {}, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none", "parallel_tool_calls": False,
                                                "messages": [{"role": "user", "content": "hi", "name": "bob"}]})
    assert r.status_code == 200, r.text


def test_cli_flags_that_cannot_work_exit_2_with_one_line(tiny_engine, tmp_path):
    import socket
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llmc.cli.main", "serve", *args], capture_output=True, text=True,
                              timeout=120)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = run(str(tiny_engine), "--port", str(port))
        assert p.returncode == 2 and f"--port {port}: already in use" in p.stderr, p.stderr
    p = run(str(tmp_path / "missing"))
    assert p.returncode == 2 and "missing" in p.stderr and "Traceback" not in p.stderr
    p = run(str(tiny_engine), "--max-body-size", "lots")
    assert p.returncode == 2 and "--max-body-size 'lots'" in p.stderr
    p = run(str(tiny_engine), "--max-queue", "0")
    assert p.returncode == 2 and "--max-queue 0: must be positive" in p.stderr
    p = run(str(tiny_engine), "--target-itl-ms", "-5")
    assert p.returncode == 2 and "--target-itl-ms -5.0: must be positive (or 0 for off)" in p.stderr, p.stderr
