"""The built-in corpus is the same text on every Python: shipped with llmc, pinned by sha256."""

from __future__ import annotations

import gzip
import sys
import tomllib
from pathlib import Path

import pytest

from llmc.quant import corpus


def test_corpus_is_the_pinned_text():
    corpus._topics.cache_clear()
    docs = corpus.pydoc_texts("all")
    # CPython 3.11.7's pydoc_data.topics: 79 topics, 464,970 characters (3.11.2 has 466,019).
    assert len(docs) == 79 and sum(map(len, docs)) == 464_970
    assert len(corpus.pydoc_texts("train")) == 71 and len(corpus.pydoc_texts("heldout")) == 8
    assert sorted(corpus.pydoc_texts("train") + corpus.pydoc_texts("heldout")) == sorted(docs)


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="the shipped text is CPython 3.11.7's")
def test_corpus_equals_cpython_3_11_7():
    from pydoc_data.topics import topics

    assert corpus.pydoc_texts("all") == [topics[k] for k in sorted(topics)]


@pytest.mark.parametrize("damage", ["modified", "missing", "not-gzip"])
def test_a_damaged_corpus_fails_clearly(tmp_path, monkeypatch, damage):
    bad = tmp_path / corpus.CORPUS_FILE.name
    if damage == "modified":
        bad.write_bytes(gzip.compress(gzip.decompress(corpus.CORPUS_FILE.read_bytes()).replace(b"for", b"FOR", 1)))
    elif damage == "not-gzip":
        bad.write_bytes(b"not gzip")
    monkeypatch.setattr(corpus, "CORPUS_FILE", bad)
    corpus._topics.cache_clear()
    try:
        with pytest.raises(corpus.CorpusError, match="reinstall llmc") as info:
            corpus.pydoc_texts("train")
    finally:
        corpus._topics.cache_clear()
    assert str(bad) in str(info.value) and "\n" not in str(info.value)
    assert info.value.exit_code == 2  # an LlmcError: the CLI prints one line


def test_corpus_is_package_data():
    """A non-editable install must carry the file (setuptools installs only what package-data lists)."""
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert corpus.CORPUS_FILE.name in pyproject["tool"]["setuptools"]["package-data"]["llmc.quant"]
