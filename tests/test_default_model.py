"""The bundled default model (trained here on pydoc_data.topics) through the whole pipeline."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmc.quant.corpus import pydoc_texts
from llmc.runtime import Engine, SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default-model"
PROMPTS = ["The for statement", "A class definition", "The with statement"]


def test_default_model_greedy_matches_transformers(default_engine):
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    engine = Engine.load(default_engine)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=64, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert out.token_ids == ref, prompt


def test_default_model_writes_documentation_english(default_engine):
    """Readable, not gibberish: most generated words are words of the documentation corpus."""
    vocabulary = set(re.findall(r"[a-z]+", " ".join(pydoc_texts("all")).lower()))
    engine = Engine.load(default_engine)
    text = " ".join(o.text for o in engine.generate(PROMPTS, SamplingParams(max_tokens=64)))
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 40, text
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.9, (known, text)


def test_default_model_graph_is_optimised(default_engine):
    """The pass pipeline at least halves the traced graph; every pass was verified (rel. error <= 1e-5)."""
    import json

    report = json.loads((default_engine / "report.json").read_text())
    graph = report["graph"]
    assert graph["nodes_final"] * 2 <= graph["nodes_traced"], graph
    errors = [p["verified_rel_error"] for p in report["passes"]]
    assert errors and all(e is not None and e <= 1e-5 for e in errors), report["passes"]
