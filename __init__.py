"""llmc: an ahead-of-time compiler for large language models.

The package is layered (see DESIGN.md): ``llmc.compiler`` turns a Hugging Face checkpoint into
an engine artifact, ``llmc.runtime`` loads and serves one without importing torch or transformers.
"""

__version__ = "0.1.0"
