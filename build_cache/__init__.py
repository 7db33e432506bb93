"""The content-addressed store of built artifacts (keys, atomic publish, locking, pruning)."""
