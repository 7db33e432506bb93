"""A checkpoint without tokenizer files builds (with a warning, recorded in report.json) into an engine that
`llmc run --prompt-ids` drives; --prompt-ids works on any engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli.main import cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _llmc(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def no_tokenizer(tiny_llama, tmp_path_factory) -> tuple[Path, Path, str]:
    """(checkpoint without tokenizer files, its engine, the build's stderr)."""
    root = tmp_path_factory.mktemp("no-tokenizer")
    skip = shutil.ignore_patterns(".done", "*.lock", *TOKENIZER_FILES)
    ckpt = shutil.copytree(tiny_llama, root / "ckpt", ignore=skip)
    code, _, err = _llmc("build", ckpt, "-o", root / "engine", "--cache-dir", root / "cache")
    assert code == 0, err
    return ckpt, root / "engine", err


def test_build_without_tokenizer_warns_and_records_it(no_tokenizer):
    ckpt, engine, err = no_tokenizer
    warning = [line for line in err.splitlines() if "tokenizer.json" in line]
    assert len(warning) == 1 and str(ckpt) in warning[0] and "--prompt-ids" in warning[0], err
    assert not any((engine / name).exists() for name in TOKENIZER_FILES)
    report = json.loads((engine / "report.json").read_text())
    assert report["tokenizer"]["text"] is False and not set(report["tokenizer"]["files"]) & set(TOKENIZER_FILES)
    code, text, err = _llmc("inspect", engine)
    assert code == 0 and "tokenizer   none: the engine takes token ids" in text, err
    assert _llmc("verify", engine)[0] == 0


def test_build_with_tokenizer_records_its_files(tiny_engine):
    report = json.loads((tiny_engine / "report.json").read_text())
    assert report["tokenizer"]["text"] is True and "tokenizer.json" in report["tokenizer"]["files"]


def test_run_prompt_ids_on_an_engine_without_tokenizer(no_tokenizer, tiny_engine):
    """Token ids in, token ids out; the same tokens as the engine built with the tokenizer."""
    _, engine, _ = no_tokenizer
    args = ("--prompt-ids", "5,6,7", "--prompt-ids", "9, 10", "-n", "6", "--ignore-eos", "--json")
    code, out, err = _llmc("run", engine, *args)
    assert code == 0, err
    outputs = json.loads(out)["outputs"]
    assert [o["prompt_token_ids"] for o in outputs] == [[5, 6, 7], [9, 10]]
    assert all(len(o["token_ids"]) == 6 and o["text"] is None and "prompt" not in o for o in outputs)
    code, same, err = _llmc("run", tiny_engine, *args)
    assert code == 0, err
    assert [o["token_ids"] for o in json.loads(same)["outputs"]] == [o["token_ids"] for o in outputs]
    code, plain, err = _llmc("run", engine, "--prompt-ids", "5,6,7", "-n", "3", "--ignore-eos")
    assert code == 0 and plain.strip() == ",".join(map(str, outputs[0]["token_ids"][:3])), (plain, err)


def test_prompt_ids_equal_the_text_prompt_on_an_engine_with_tokenizer(tiny_engine):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_engine / "tokenizer.json")).encode("The for statement").ids
    code, by_text, err = _llmc("run", tiny_engine, "--prompt", "The for statement", "-n", "5", "--json")
    assert code == 0, err
    code, by_ids, err = _llmc("run", tiny_engine, "--prompt-ids", ",".join(map(str, ids)), "-n", "5", "--json")
    assert code == 0, err
    a, b = json.loads(by_text), json.loads(by_ids)
    assert a["prompt_token_ids"] == b["prompt_token_ids"] == ids
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"] and isinstance(b["text"], str)


@pytest.mark.parametrize("args, needles", [
    (("--prompt", "hello"), ("no tokenizer.json", "token ids")),
    (("--prompt-ids", "1,x,3"), ("--prompt-ids '1,x,3'", "comma-separated")),
    (("--prompt-ids", "1,99999"), ("99999", "outside the vocabulary", "0..511")),
    ((), ("--prompt", "--prompt-ids")),
    (("--prompt", "a", "--prompt-ids", "1"), ("one of the two",)),
], ids=["text-without-tokenizer", "not-ids", "out-of-vocabulary", "no-prompt", "both"])
def test_run_refuses_bad_prompts_in_one_line(no_tokenizer, args, needles):
    _, engine, _ = no_tokenizer
    code, _, err = _llmc("run", engine, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert all(n in lines[0] for n in needles), (needles, lines[0])


def test_quantized_build_without_tokenizer_is_refused(no_tokenizer, tmp_path):
    ckpt, _, _ = no_tokenizer
    code, _, err = _llmc("build", ckpt, "-o", tmp_path / "out", "--cache-dir", tmp_path / "cache", "--quant", "int4")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: ") and "no tokenizer.json" in last and "--quant" in last, err
    assert "[2/5]" not in err and not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
