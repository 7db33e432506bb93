"""The ordered pass pipeline for a recipe and target, with optional differential verification."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx_ir as ir

from llmc.errors import LlmcError
from llmc.passes import base
from llmc.passes.base import GraphPass
from llmc.passes.registry import ALL_PASSES, BACKEND_FUSIONS, BY_NAME

ALL_FUSIONS = "all-fusions"


def passes_for(target: str, disabled: Sequence[str] = (), extra: Sequence[GraphPass] = ()) -> list[GraphPass]:
    """The passes to run, in order, for ``target``.

    ``disabled`` names passes to skip (``all-fusions`` skips every fusion, leaving cleanup);
    disabling a pass that another enabled pass requires disables that one too. ``extra`` passes
    (Python API only) run after the standard ones, before the final dead-code elimination.
    """
    unknown = [d for d in disabled if d not in BY_NAME and d not in BACKEND_FUSIONS and d != ALL_FUSIONS]
    if unknown:
        names = [*BY_NAME, *BACKEND_FUSIONS, ALL_FUSIONS]
        raise LlmcError(
            f"--disable-pass {unknown[0]!r}: no such pass; choose from {', '.join(names)} "
            "(see `llmc build --print-passes`)"
        )
    off = set(disabled)
    if ALL_FUSIONS in off:
        off |= {p.name for p in ALL_PASSES if p.fusion}
    chosen: list[GraphPass] = []
    for p in ALL_PASSES:
        if p.name in off or any(r in off for r in p.requires):
            off.add(p.name)
            continue
        chosen.append(p)
    if extra:
        chosen[-1:-1] = list(extra)
    return chosen


Verifier = Callable[[str, ir.Model], None]


def run_pipeline(model: ir.Model, passes: Sequence[GraphPass], verify: Verifier | None = None,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """Run ``passes`` in place; after each, ``verify(pass_name, model)`` if given. Returns per-pass statistics."""
    stats = []
    for p in passes:
        if progress:
            progress(p.name)
        try:
            s = base.apply(p, model)
        except Exception as exc:
            cause = _user_error(exc)
            if cause is None:
                raise
            raise cause from None
        stats.append({"pass": p.name, **s})
        if verify is not None:
            verify(p.name, model)
    return stats


def _user_error(exc: BaseException) -> LlmcError | None:
    """The :class:`LlmcError` under ``exc``, if any: onnx_ir wraps whatever a rewrite raises in layers of
    PassError, and a pass that reads weights meets the checkpoint's faults (a file deleted mid-build)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LlmcError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def backend_fusion_enabled(name: str, disabled: Sequence[str]) -> bool:
    """Whether the backend fusion ``name`` (a key of BACKEND_FUSIONS) runs, given ``--disable-pass`` names."""
    return name not in disabled and ALL_FUSIONS not in disabled
