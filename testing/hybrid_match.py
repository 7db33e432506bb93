"""Build the families whose lowering leans on transformers' internals (``llmc.testing.hybrids.RELEASED_LAYOUTS``:
Qwen3.5, Qwen3-Next, Falcon-H1, LFM2 in their released layer layouts) with the architecture self-check on, and hold
each engine's greedy tokens to the installed transformers' ``generate``.

``python -m llmc.testing.hybrid_match WORK_DIR`` runs them under whatever transformers is first on the path (the
test of the lowest declared version puts that one first) and prints one JSON object: model type -> outcome.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

NEW_TOKENS = 12


def check(model_type: str, work: Path) -> dict:
    """{"outcome": "match" | "differ" | "refused", ...} for one family built in ``work``."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.errors import LlmcError
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.hybrids import PROMPTS, RELEASED_LAYOUTS, greedy, write_hybrid

    hf = write_hybrid(model_type, work / "ckpt", fields=RELEASED_LAYOUTS[model_type], centred_norms=True)
    try:
        result = build(work / "ckpt", work / "engine", BuildOptions())
    except LlmcError as exc:
        return {"outcome": "refused", "exit": exc.exit_code, "message": str(exc)}
    refs = greedy(hf, PROMPTS, NEW_TOKENS)
    engine = Engine.load(work / "engine", kv_cache_tokens=512, max_num_tokens=16)
    got = [o.token_ids for o in engine.generate([list(p) for p in PROMPTS],
                                                SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]
    self_check = result.build_info.get("self_check") or {}
    return {"outcome": "match" if got == refs else "differ", "self_check": self_check.get("status"),
            "got": got, "want": refs}


def check_all(work: Path) -> dict[str, dict]:
    """Every family of ``RELEASED_LAYOUTS`` with the self-check on (LLMC_SELF_CHECK=1 for this process)."""
    from llmc.testing.hybrids import RELEASED_LAYOUTS

    before = os.environ.get("LLMC_SELF_CHECK")
    os.environ["LLMC_SELF_CHECK"] = "1"
    try:
        return {t: check(t, work / t) for t in RELEASED_LAYOUTS}
    finally:
        if before is None:
            os.environ.pop("LLMC_SELF_CHECK", None)
        else:
            os.environ["LLMC_SELF_CHECK"] = before


if __name__ == "__main__":
    import transformers

    outcome = check_all(Path(sys.argv[1]))
    print(json.dumps({"transformers": transformers.__version__, "families": outcome}))
