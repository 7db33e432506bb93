"""The content-addressed store of built artifacts (keys, atomic publish, locking, pruning).

:mod:`.key` computes a key from everything that shapes an engine; :mod:`.store` keeps one
complete artifact per key. ``llmc.compiler.build.build_cached`` puts them together.
"""

from llmc.build_cache.key import KeyInputs, canonical_json, sources_digest
from llmc.build_cache.sizes import format_size, parse_size
from llmc.build_cache.store import Entry, Store, default_root

__all__ = ["Entry", "KeyInputs", "Store", "canonical_json", "default_root", "format_size", "parse_size",
           "sources_digest"]
