"""Test support that ships with llmc: locally generated fixture checkpoints and the pydoc corpus."""
