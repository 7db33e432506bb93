"""Test support that ships with llmc: locally generated fixture checkpoints and the BPE tokenizer trained on the
pydoc corpus (the corpus itself is product data: llmc.quant.corpus)."""
