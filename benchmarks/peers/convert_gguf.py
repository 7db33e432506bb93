#!/usr/bin/env python3
"""Run llama.cpp's convert_hf_to_gguf.py (as shipped in the llama-cpp-python sdist)
on our locally made model.

Our tokenizer is a fresh byte-level BPE (GPT-2 pre-tokenizer regex), so its
checksum is not in the converter's table of known pre-tokenizers and the
converter would refuse it.  We tell it that the pre-tokenizer is "gpt-2" (llama.cpp's
name for the GPT-2 regex), which is what tokenizers.pre_tokenizers.ByteLevel(use_regex=True)
implements.  Nothing else is changed.

usage: convert_gguf.py <hf_dir> <out.gguf> <outtype: f32|f16|bf16|q8_0> [converter options...]
  e.g. --no-mtp for a Qwen3.5 / Qwen3-Next checkpoint without multi-token-prediction layers (the converter asserts
  they exist unless told)
"""
import os
import runpy
import sys

ROOT = os.environ.get("PEERS_ROOT", os.path.expanduser("~/.cache/llmc-peers"))
LLAMA_DIR = os.environ.get("LLAMA_CPP_SRC", os.path.join(ROOT, "llama.cpp"))  # setup.sh links the sdist's copy
# The PyPI gguf 0.19.0 wheel lacks gguf.LazyChunkedTensor, which this converter
# needs, so (like the converter itself does by default) use the gguf-py that
# ships next to it.
sys.path.insert(0, f"{LLAMA_DIR}/gguf-py")
sys.path.insert(0, LLAMA_DIR)

import conversion.base as base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"

hf_dir, out, outtype = sys.argv[1:4]
sys.argv = [f"{LLAMA_DIR}/convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype, *sys.argv[4:]]
runpy.run_path(f"{LLAMA_DIR}/convert_hf_to_gguf.py", run_name="__main__")
