"""The runtime: load an engine artifact and serve generation. Imports no torch and no transformers.

Rooms: ``engine`` (the ``Engine`` façade) and ``loaders/`` (one loader per executor); ``core/`` (requests,
scheduler, KV pool, block manager, state slots, one step); ``workers/`` (ONNX Runtime, CUDA); ``speculative/``;
``sampling/`` (host sampler, structured outputs); ``lora/``; ``artifact`` (the artifact format, shared with the
compiler); ``outputs``, ``streaming`` and ``tokenizer``.
"""

from llmc.runtime.core.scheduler import SchedulerConfig
from llmc.runtime.engine import Engine
from llmc.runtime.outputs import EngineStats, GenerationOutput, RequestOutput, StreamEvent
from llmc.runtime.sampling.sampler import SamplingParams
from llmc.runtime.sampling.structured import StructuredConfig, StructuredOutputs

__all__ = ["Engine", "EngineStats", "GenerationOutput", "RequestOutput", "SamplingParams", "SchedulerConfig",
           "StreamEvent", "StructuredConfig", "StructuredOutputs"]
