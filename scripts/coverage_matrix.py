"""Generate the architecture coverage matrix (docs/coverage.md + docs/coverage.json) by running it.

For every supported ``model_type`` (``llmc.compiler.checkpoint.SUPPORTED_MODEL_TYPES``), on its
tiny random fixture (``llmc.testing.checkpoints.write_tiny_model``, the architecture tests' seed), and
every family tried outside that list (``llmc.testing.tried_families``; a refusal is recorded with its
reason), with the architecture self-check on (its result is a column):

1. build the fp32 CPU engine and compare 32 greedy tokens with transformers' ``generate`` for 3
   prompts (3, 20 and 45 tokens), then run the 3 prompts as one packed batch and compare with
   the single-prompt runs;
2. build the int4 and the fp8 (emulated on the CPU) engines with the default recipes and
   measure their top-1 agreement with the fp32 engine: the fp32 engine generates 128 greedy
   tokens after each prompt, both engines score those sequences (teacher forcing), and the
   fraction of the 3 x 128 generated positions whose argmax agrees is reported;
3. list the fusion passes that fired, from the fp32 artifact's report.json.

Nothing in the output is written by hand. A stage that fails is recorded with its error. Builds
go through llmc's build cache, and fixtures are kept in ``--work-dir``, so a rerun without source
changes takes seconds (any change to llmc's sources changes every cache key).

    python scripts/coverage_matrix.py                       # all families, writes docs/coverage.{md,json}
    python scripts/coverage_matrix.py --families llama,phi3 --out-md /tmp/c.md --out-json /tmp/c.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import version
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (3, 20, 45)  # as tests/test_architectures.py: crosses the fixtures' sliding window (24)
GREEDY_TOKENS = 32
AGREEMENT_TOKENS = 128
PROMPT_SEED = 0
FIXTURE_SEED = 3  # tests/conftest.py family_build
QUANT_FORMATS = ("int4", "fp8")
HYBRID_STD = 0.15
COMMAND = "python scripts/coverage_matrix.py"


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def _fixture(family: str, work: Path) -> Path:
    """The family's tiny checkpoint, written once per fixture config (the directory name hashes it)."""
    from llmc.testing.checkpoints import TINY_CONFIGS, write_tiny_model

    spec = json.dumps({"config": TINY_CONFIGS[family], "seed": FIXTURE_SEED}, sort_keys=True)
    path = work / "checkpoints" / f"{family}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if not (path / ".done").exists():
        write_tiny_model(family, path, seed=FIXTURE_SEED)
        (path / ".done").touch()
    return path


def _tried_fixture(family: str, work: Path) -> Path:
    """A family outside the tested list, as tests/test_mechanisms.py tries it (llmc.testing.tried_families)."""
    from llmc.testing.tried_families import MATRIX_ONLY_FAMILIES, TRIED_FAMILIES, write_tried_family

    spec = json.dumps({"config": {**TRIED_FAMILIES, **MATRIX_ONLY_FAMILIES}[family][0], "seed": 0}, sort_keys=True)
    path = work / "checkpoints" / f"{family}-tried-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if not (path / ".done").exists():
        write_tried_family(family, path)
        (path / ".done").touch()
    return path


def _hybrid_fixture(family: str, work: Path) -> Path:
    """A hybrid family's tiny checkpoint (``llmc.testing.hybrids``: recurrent layers beside attention), written as
    tests/test_hybrid_quant.py writes it: with a tokenizer (quantized builds calibrate on text), matrices at std 0.15
    as ``write_tiny_model`` draws them, ``1 + weight`` norms around 0."""
    from llmc.testing.hybrids import HYBRID_CONFIGS, write_hybrid

    spec = json.dumps({"config": HYBRID_CONFIGS[family], "seed": FIXTURE_SEED, "std": HYBRID_STD}, sort_keys=True)
    path = work / "checkpoints" / f"{family}-hybrid-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if not (path / ".done").exists():
        write_hybrid(family, path, seed=FIXTURE_SEED, tokenizer=True, std=HYBRID_STD, centred_norms=True)
        (path / ".done").touch()
    return path


def _self_check(engine_dir: Path) -> dict:
    """What the build's architecture self-check found (report.json; its errors from build_info.json)."""
    report = json.loads((engine_dir / "report.json").read_text()).get("self_check", {})
    info_file = engine_dir / "build_info.json"
    info = json.loads(info_file.read_text()).get("self_check", {}) if info_file.is_file() else {}
    return {"result": report.get("result", "not run"), "status": info.get("status"),
            "max_logprob_error": info.get("max_logprob_error"), "max_logit_rel_error": info.get("max_logit_rel_error")}


def _build(ckpt: Path, out: Path, quant: str | None, cache_dir: str | None) -> tuple[Path, dict]:
    from llmc.compiler.build import BuildOptions, build_cached
    from llmc.quant.recipe import QuantRecipe

    options = BuildOptions(force=True, quant=QuantRecipe(quant=quant) if quant else QuantRecipe())
    result = build_cached(ckpt, out, options, cache_dir=cache_dir)
    return out, {"cache_hit": result.cache_hit, "seconds": round(sum(result.timings.values()), 1)}


def _greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def _fusions(engine_dir: Path) -> dict[str, int]:
    """Fusion passes (the registry's ``fusion`` flag) and backend fusions with at least one match, from report.json."""
    from llmc.passes.registry import BY_NAME

    report = json.loads((engine_dir / "report.json").read_text())
    fired = {p["pass"]: p["matches"] for p in report["passes"]
             if p["pass"] in BY_NAME and BY_NAME[p["pass"]].fusion and p["matches"] > 0}
    fired.update({k: v for k, v in report.get("backend_fusions", {}).items() if v > 0})
    return fired


def run_family(family: str, work: Path, cache_dir: str | None) -> dict:
    """Every figure of one matrix row; failures are recorded, not raised."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmc.compiler.checkpoint import HYBRID_MODEL_TYPES
    from llmc.errors import UnsupportedError
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.tried_families import MATRIX_ONLY_FAMILIES, TRIED_FAMILIES

    tried = {**TRIED_FAMILIES, **MATRIX_ONLY_FAMILIES}  # both are rows of the second table

    t0 = time.perf_counter()
    row: dict = {"model_type": family, "tried": family in tried}
    if row["tried"]:
        row["mechanism"] = tried[family][1]
    if family in HYBRID_MODEL_TYPES:  # rows of the third table
        row["hybrid"] = HYBRID_MODEL_TYPES[family]
    try:
        ckpt = (_hybrid_fixture(family, work) if "hybrid" in row else
                _tried_fixture(family, work) if row["tried"] else _fixture(family, work))
        fp32_dir, row["fp32_build"] = _build(ckpt, work / "engines" / f"{family}-fp32", None, cache_dir)
    except UnsupportedError as exc:  # a refusal with its reason: a result, not a failure
        row["refused"] = str(exc).replace(str(ckpt), "<checkpoint>").split(": ", 1)[-1]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        return row
    except Exception as exc:  # noqa: BLE001 - recorded in the matrix
        row["fp32_error"] = _error(exc)
        traceback.print_exc()
        return row
    row["self_check"] = _self_check(fp32_dir)
    row["fusions"] = _fusions(fp32_dir)
    row["rope_recompute_at"] = json.loads((fp32_dir / "manifest.json").read_text())["engine"].get("rope_recompute_at")

    rng = np.random.default_rng(PROMPT_SEED)
    engine = Engine.load(fp32_dir)
    prompts = [rng.integers(4, engine.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    single = [engine.generate([p], greedy)[0].token_ids for p in prompts]
    reference = [_greedy_hf(hf, p, GREEDY_TOKENS) for p in prompts]
    row["fp32_vs_transformers"] = {
        "match": single == reference,
        "first_difference": {len(p): _first_difference(s, r) for p, s, r in zip(prompts, single, reference,
                                                                                   strict=True) if s != r},
    }
    batched = [o.token_ids for o in engine.generate(prompts, greedy)]
    row["batch_equals_single"] = batched == single
    del hf

    # The fp32 engine's own continuations, scored by every engine (teacher forcing).
    long = SamplingParams(max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    sequences = [p + o.token_ids for p, o in zip(prompts, engine.generate(prompts, long), strict=True)]
    reference_top1 = [engine.score(s).argmax(-1) for s in sequences]
    del engine
    for quant in QUANT_FORMATS:
        entry: dict = {}
        row[quant] = entry
        try:
            q_dir, entry["build"] = _build(ckpt, work / "engines" / f"{family}-{quant}", quant, cache_dir)
        except Exception as exc:  # noqa: BLE001 - recorded in the matrix
            entry["error"] = _error(exc)
            traceback.print_exc()
            continue
        report = json.loads((q_dir / "report.json").read_text())
        accuracy, recipe = report.get("accuracy", {}), report.get("quantization", {})
        # The build's own check: held-out text, the quantized graph against the unquantized one.
        entry["build_report"] = {k: accuracy.get(k) for k in ("top1_agreement", "kl_mean", "ppl_increase_pct")}
        # What the quantize pass rewrote (matches: weight MatMuls in the format; lm_head_int8 etc.).
        entry["rewritten"] = recipe.get("graph", {})
        # The recipe as the artifact records it (the manifest's canonical recipe, whatever llmc's defaults are now).
        manifest_recipe = json.loads((q_dir / "manifest.json").read_text())["recipe"]["quant"]
        entry["recipe"] = {**manifest_recipe, "algorithm": recipe.get("algorithm"),
                           "emulated_on_cpu": recipe.get("emulated_on_cpu")}
        q_engine = Engine.load(q_dir)
        agree = total = 0
        for p, s, ref in zip(prompts, sequences, reference_top1, strict=True):
            got = q_engine.score(s).argmax(-1)
            rows = slice(len(p) - 1, len(s) - 1)  # the positions that predicted the generated tokens
            agree += int((got[rows] == ref[rows]).sum())
            total += len(s) - len(p)
        entry["top1_agreement"] = agree / total
        entry["positions"] = total
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _cell_quant(entry: dict | None, quant: str) -> str:
    if entry is None:
        return "not run"
    if "error" in entry:
        return f"build failed: {entry['error'][:120]}"
    rewritten = entry.get("rewritten", {})
    n = rewritten.get("matches", 0)
    parts = [f"{n} weight MatMul{'' if n == 1 else 's'}"]
    if rewritten.get("expert_weights_int4"):
        parts.append(f"{rewritten['expert_weights_int4']} batched expert weights")
    kept = []
    if rewritten.get("expert_weights_kept"):
        kept.append(f"{rewritten['expert_weights_kept']} batched expert weights")
    if rewritten.get("routers_kept"):
        kept.append(f"{rewritten['routers_kept']} routers")
    text = f"{entry['top1_agreement']:.3f} ({' + '.join(parts)} in {quant}"
    return text + (f"; {' and '.join(kept)} stay fp32)" if kept else ")")


def _recipe_text(rows: list[dict], quant: str) -> str:
    """The recipe of ``quant`` as the builds' report.json recorded it (the same for every family)."""
    recipes = {json.dumps(r[quant]["recipe"], sort_keys=True) for r in rows if "recipe" in r.get(quant, {})}
    if len(recipes) != 1:
        return f"`--quant {quant}`"
    r = json.loads(recipes.pop())
    parts = [r["algorithm"]]
    if quant.startswith("int4"):  # group size, embeddings and lm_head apply to the int4 formats only
        parts += [f"group {r['group_size']}", "symmetric" if r["symmetric"] else "asymmetric (zero point)",
                  f"{r['embeddings']} embeddings", f"{r['lm_head']} lm_head"]
    if r.get("calib_samples") and quant == "fp8":
        parts.append(f"calibrated on {r['calib_samples']} x {r['calib_seq_len']} tokens")
    parts += ["emulated on the CPU"] if r["emulated_on_cpu"] else []
    return f"`--quant {quant}` ({', '.join(parts)})"


def render_markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        "# Architecture coverage matrix",
        "",
        f"<!-- Generated by `{COMMAND}`; do not edit by hand. -->",
        f"Generated by `{COMMAND}` (writes this file and `docs/coverage.json`); do not edit it by hand. "
        f"Last run: {meta['generated_at']} with llmc {meta['llmc']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, onnxruntime {meta['onnxruntime']}, target `cpu`.",
        "",
        "Each row is one supported `model_type`, measured on its tiny random fixture "
        f"(`llmc.testing.checkpoints.write_tiny_model`, seed {FIXTURE_SEED}):",
        "",
        f"- **fp32 = transformers**: the fp32 engine's {GREEDY_TOKENS} greedy tokens equal transformers' `generate` "
        f"for {len(PROMPT_LENGTHS)} prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens; **batch = single**: the "
        "same prompts as one packed batch give the single-prompt tokens.",
        f"- **int4 / fp8 top-1**: default recipes, {_recipe_text(data['rows'], 'int4')} and "
        f"{_recipe_text(data['rows'], 'fp8')}. Top-1 agreement with the fp32 engine, teacher-forced "
        f"on the fp32 engine's own {AGREEMENT_TOKENS} greedy tokens after each prompt "
        f"({len(PROMPT_LENGTHS)} x {AGREEMENT_TOKENS} positions). The fixtures' weights are random, so their "
        "next-token distributions are flat and these figures show quantization noise, not a real model's "
        "accuracy. In brackets: how many weight MatMuls the quantize pass rewrote into the format (a "
        "count below the family's linear layers means some stay in fp32; int4 builds keep the lm_head in int8, "
        "which is not counted; fp8 counts it), and for mixture-of-experts models what happened to the experts' "
        "batched `[E, N, K]` weights (int4: stored INT4 behind `GatherBlockQuantized`, round-to-nearest; fp8: "
        "kept fp32, there is no per-expert activation range) and the routers (always fp32). "
        "`docs/coverage.json` also holds each build's own held-out figures (top-1, KL, perplexity).",
        "- **fusions fired**: fusion passes with at least one match in the fp32 build (`report.json`), with counts; "
        "`rotary-attention` is the ONNX Runtime backend's fusion into `llmc.RotaryPagedAttention` (per layer).",
        "",
        "- **self-check**: the fp32 build's architecture self-check (`compiler/selfcheck.py`: a random twin of "
        "the config through the same pipeline, held to transformers), with its largest log-probability error "
        "(nats) where this run computed it (a cached check shows `passed (cached)`).",
        "",
        "The second table lists families outside the tested list, tried as a new user would "
        "(`llmc.testing.tried_families`, one per mechanism current models use): each either builds an engine "
        "that matches transformers (same columns) or is refused before any work, with the reason shown.",
        "",
        "| model_type | fp32 = transformers | batch = single | self-check | int4 top-1 | fp8 (emulated) top-1 | "
        "fusions fired |",
        "|---|---|---|---|---|---|---|",
    ]
    tried = [r for r in data["rows"] if r.get("tried")]
    hybrid = [r for r in data["rows"] if r.get("hybrid") and not r.get("tried")]
    for row in [r for r in data["rows"] if not r.get("tried") and not r.get("hybrid")]:
        lines.append(_row_markdown(row))
    if tried:
        lines += ["", "| model_type (mechanism) | fp32 = transformers | batch = single | self-check | int4 top-1 | "
                  "fp8 (emulated) top-1 | fusions fired |", "|---|---|---|---|---|---|---|"]
        lines += [_row_markdown(r) for r in tried]
    if hybrid:
        lines += ["", "The third table lists the hybrid families: recurrent layers (short convolutions, Gated "
                  "DeltaNet, Mamba2) beside attention, with a per-sequence state slot beside the paged KV cache "
                  "(`llmc.runtime.core.state_cache`). Their fixtures are `llmc.testing.hybrids.write_hybrid` "
                  f"(seed {FIXTURE_SEED}, with a tokenizer, matrices at std {HYBRID_STD}, `1 + weight` norms around "
                  "0), the same columns.", "",
                  "| model_type (recurrent layers) | fp32 = transformers | batch = single | self-check | int4 top-1 | "
                  "fp8 (emulated) top-1 | fusions fired |", "|---|---|---|---|---|---|---|"]
        lines += [_row_markdown(r) for r in hybrid]
    for splice in data["meta"].get("spliced", []):
        lines += ["", f"Rows of {', '.join(splice['families'])} regenerated on {splice['generated_at']} "
                  f"(`{COMMAND} --splice --families ...`, {splice['seconds']} s) and spliced into the last full run."]
    lines.append("")
    return "\n".join(lines)


def _self_check_cell(row: dict) -> str:
    check = row.get("self_check") or {}
    if check.get("result") != "passed":
        return check.get("result", "not run")
    if check.get("status") == "cached" or check.get("max_logprob_error") is None:
        return "passed (cached)"
    return f"passed ({check['max_logprob_error']:.1e})"


def _row_markdown(row: dict) -> str:
    family = row["model_type"] + (f" ({row['mechanism']})" if row.get("tried") else
                                  f" ({row['hybrid']})" if row.get("hybrid") else "")
    if "refused" in row:
        return f"| {family} | refused: {row['refused']} | | | | | |"
    if "fp32_error" in row:
        return f"| {family} | build failed: {row['fp32_error'][:120]} | | | | | |"
    check = row["fp32_vs_transformers"]
    fp32 = "yes" if check["match"] else "NO (first difference at token " + ", ".join(
        f"{i} for the {n}-token prompt" for n, i in check["first_difference"].items()) + ")"
    if row.get("rope_recompute_at"):
        fp32 += f" (longrope: KV recomputed past {row['rope_recompute_at']} tokens)"
    fusions = ", ".join(f"{k} ×{v}" for k, v in row["fusions"].items()) or "none"
    return (f"| {family} | {fp32} | {'yes' if row['batch_equals_single'] else 'NO'} | {_self_check_cell(row)} | "
            f"{_cell_quant(row.get('int4'), 'int4')} | {_cell_quant(row.get('fp8'), 'fp8')} | {fusions} |")


def main(argv: list[str] | None = None) -> int:
    from llmc.compiler.checkpoint import SUPPORTED_MODEL_TYPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated model_types (default: every supported one)")
    parser.add_argument("--work-dir", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmc-coverage",
                        help="fixtures and engines (reused between runs)")
    parser.add_argument("--cache-dir", help="llmc build cache (default: $LLMC_CACHE_DIR or the user cache)")
    parser.add_argument("--out-md", type=Path, default=REPO_ROOT / "docs" / "coverage.md")
    parser.add_argument("--out-json", type=Path, default=REPO_ROOT / "docs" / "coverage.json")
    parser.add_argument("--jobs", type=int, default=1, help="families measured in parallel processes")
    parser.add_argument("--splice", action="store_true",
                        help="replace (or add) only the measured families' rows in --out-json's last run, and "
                             "re-render --out-md from it")
    args = parser.parse_args(argv)

    from llmc.compiler.checkpoint import HYBRID_MODEL_TYPES
    from llmc.testing.tried_families import MATRIX_ONLY_FAMILIES, TRIED_FAMILIES

    known = [*SUPPORTED_MODEL_TYPES, *sorted({**TRIED_FAMILIES, **MATRIX_ONLY_FAMILIES}),
             *(f for f in HYBRID_MODEL_TYPES if f not in SUPPORTED_MODEL_TYPES)]
    families = args.families.split(",") if args.families else known
    unknown = [f for f in families if f not in known]
    if unknown:
        parser.error(f"--families: {', '.join(unknown)} unknown; choose from {', '.join(known)}")
    os.environ["LLMC_SELF_CHECK"] = "1"  # the matrix reports the self-check: never skip it
    args.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # With --splice: the run whose rows this one replaces, read once (before this run writes over it).
    last = json.loads(args.out_json.read_text()) if args.splice else None
    rows: list[dict] = []

    def save() -> dict:
        """Write both files with the rows measured so far (after every family: a run cut short keeps its rows)."""
        import llmc

        data = {
            "meta": {
                "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "command": COMMAND,
                "llmc": llmc.__version__,
                **{pkg: version(pkg) for pkg in ("torch", "transformers", "onnxruntime")},
                "prompt_lengths": list(PROMPT_LENGTHS),
                "greedy_tokens": GREEDY_TOKENS,
                "agreement_tokens": AGREEMENT_TOKENS,
                "seconds": round(time.perf_counter() - t0, 1),
            },
            "rows": rows,
        }
        if last is not None:
            data = _splice(last, data, [r["model_type"] for r in rows])
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        args.out_md.parent.mkdir(parents=True, exist_ok=True)
        args.out_md.write_text(render_markdown(data))
        return data

    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {f: pool.submit(run_family, f, args.work_dir, args.cache_dir) for f in families}
        for family, fut in futures.items():
            try:
                rows.append(fut.result())
            except Exception as exc:  # noqa: BLE001 - a crash in one family is a row, not the end of the run
                rows.append({"model_type": family, "fp32_error": _error(exc)})
            save()
            print(f"{family}: done ({rows[-1].get('seconds', '?')} s)", file=sys.stderr, flush=True)
    data = save()
    failed = [r["model_type"] for r in rows if "refused" not in r and (
              "fp32_error" in r or not r["fp32_vs_transformers"]["match"] or not r["batch_equals_single"])]
    print(f"wrote {args.out_md} and {args.out_json} in {data['meta']['seconds']} s"
          + (f"; fp32 mismatches: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def _splice(last: dict, new: dict, families: list[str]) -> dict:
    """``last`` (a full run) with the rows of ``families`` replaced by (or added from) ``new``'s, its meta kept and
    the splice recorded in ``meta.spliced``."""
    by_family = {r["model_type"]: r for r in new["rows"]}
    rows = [by_family.pop(r["model_type"], r) for r in last["rows"]]
    meta = dict(last["meta"])
    meta["spliced"] = [s for s in meta.get("spliced", []) if not set(s["families"]) <= set(families)]
    meta["spliced"].append({"families": families, "generated_at": new["meta"]["generated_at"],
                            "seconds": new["meta"]["seconds"],
                            **{k: new["meta"][k] for k in ("llmc", "torch", "transformers", "onnxruntime")}})
    return {"meta": meta, "rows": rows + list(by_family.values())}


if __name__ == "__main__":
    sys.exit(main())
