"""The runtime: load an engine artifact and serve generation. Imports no torch and no transformers."""

from llmc.runtime.engine import Engine, GenerationOutput
from llmc.runtime.sampler import SamplingParams

__all__ = ["Engine", "GenerationOutput", "SamplingParams"]
