"""The runtime: load an engine artifact and serve generation. Imports no torch and no transformers."""

from llmc.runtime.engine import Engine, EngineStats, GenerationOutput, RequestOutput, StreamEvent
from llmc.runtime.sampler import SamplingParams
from llmc.runtime.scheduler import SchedulerConfig
from llmc.runtime.structured import StructuredConfig, StructuredOutputs

__all__ = ["Engine", "EngineStats", "GenerationOutput", "RequestOutput", "SamplingParams", "SchedulerConfig",
           "StreamEvent", "StructuredConfig", "StructuredOutputs"]
