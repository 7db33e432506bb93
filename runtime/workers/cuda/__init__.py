"""The CUDA engine's executor: the program of torch ops a ``--gpu`` build writes (``program``, ``ops``), the
session that runs it with a paged KV cache and the ahead-of-time Triton kernels (``session``, ``kernels``),
sampling on the device (``sampler``), tensor-parallel ranks over torch.distributed (``tensor_parallel``) and the
decode-step profiler (``step_profile``). The rest of ``llmc.runtime`` (engine, scheduler, KV blocks, sampling,
decoding features) imports this package only when an engine is a CUDA one, so the CPU runtime never loads torch.
"""
