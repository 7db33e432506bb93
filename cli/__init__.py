"""The ``llmc`` command line (click). Thin: parses flags, calls library functions, prints."""
