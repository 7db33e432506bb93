"""``llmc build`` as ordered stages behind a backend protocol.

- :mod:`.options`: :class:`BuildOptions`, validation, the canonical recipe (cache key).
- :mod:`.plan`: the plan (options as run, target, the backend from compiler/backends/registry.py), before any work.
- :mod:`.driver`: :func:`build` and :func:`build_cached`; stages load and check (:mod:`.checks`) shared by both.
- :mod:`.stages`: the compile stages in order (quantize, self-check, trace, passes, self-check-join, emit, write,
  score, finish) over one :class:`.state.BuildState`; :mod:`.manifest` assembles report.json and the manifest,
  :mod:`.scoring` the accuracy report, :mod:`.self_check` the twin beside the build, :mod:`.publish` atomic output.
"""

from llmc.compiler.build.driver import build, build_cached, cache_key_inputs
from llmc.compiler.build.options import COMPUTE_DTYPE, BuildOptions, BuildResult, canonical_recipe
from llmc.compiler.build.plan import Plan, make_plan, uses_cuda_engine

__all__ = ["COMPUTE_DTYPE", "BuildOptions", "BuildResult", "Plan", "build", "build_cached", "cache_key_inputs",
           "canonical_recipe", "make_plan", "uses_cuda_engine"]
