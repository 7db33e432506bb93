"""``llmc``: build, run, verify and inspect engines.

Exit codes: 0 success; 1 verification found problems; 2 bad input, or a path llmc cannot read or write (disk
full, read-only, permission denied, an input deleted mid-build); 3 unsupported request;
4 accuracy gate failed; 5 out of memory (--max-memory or the machine's); 6 incomplete install (a compiled part of
llmc missing); 70 internal error (a bug: please report it with LLMC_DEBUG=1 output).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import click

from llmc import __version__
from llmc.errors import EXIT_INTERNAL, LlmcError, os_fault, os_fault_errno


class _Group(click.Group):
    """Turns every LlmcError into one line on stderr and its exit code; never a bare traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LlmcError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, SystemExit):
            raise
        except OSError as exc:
            # A full disk or a read-only directory is the user's to fix, wherever it strikes. A missing file
            # is not converted here: llmc names the inputs it reads itself, so one that escapes is a bug.
            if os_fault_errno(exc) in (None, errno.ENOENT, errno.ENOTDIR):
                self._internal(exc)
            fault = os_fault(exc)
            click.echo(f"error: {fault}", err=True)
            sys.exit(fault.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            self._internal(exc)

    @staticmethod
    def _internal(exc: BaseException) -> None:
        if os.environ.get("LLMC_DEBUG"):
            traceback.print_exc()
        click.echo(f"internal error: {type(exc).__name__}: {exc} (rerun with LLMC_DEBUG=1 and report it)", err=True)
        sys.exit(EXIT_INTERNAL)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmc")
def cli() -> None:
    """llmc: compile a Hugging Face checkpoint ahead of time into an engine, then run it.

    \b
      llmc build ./ckpt --target cpu -o engines/m     # checkpoint -> engine artifact
      llmc run engines/m --prompt "Hello"             # generate
      llmc bench engines/m --batch 1,8                # tok/s, TTFT, memory-bandwidth fraction
      llmc verify engines/m                           # integrity + "can this machine load it?"
      llmc pack engines/m -o m.tar; llmc unpack m.tar -o engines/m2
      llmc cache ls                                   # the build cache
      llmc inspect engines/m                          # manifest and report
      llmc targets                                    # what can be built
      llmc plan ./ckpt --gpu h100 --tp 1,2,4,8        # GPU memory, KV room, roofline per GPU
      llmc serve engines/m --port 8000                # OpenAI-compatible HTTP server
    """
    _warnings_to_stderr()


class _Warnings(logging.Handler):
    """llmc's logged warnings (untested model type, no tokenizer, ...) as ``warning: ...`` lines on the
    stderr of the moment (click.echo looks it up per call, so a captured stderr gets them too)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"warning: {record.getMessage()}", err=True)


def _warnings_to_stderr() -> None:
    logger = logging.getLogger("llmc")
    if not any(isinstance(h, _Warnings) for h in logger.handlers):
        logger.addHandler(_Warnings(logging.WARNING))


def _print_passes(ctx: click.Context, _param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from llmc.compiler.backends.registry import BACKENDS
    from llmc.compiler.build import BuildOptions
    from llmc.passes.recipe import RECIPE_PASSES
    from llmc.passes.registry import ALL_PASSES

    def row(name: str, kind: str, description: str) -> None:
        click.echo(f"  {name:24} {kind:8} {description}")

    click.echo("graph pipeline (every build, in order; --disable-pass NAME):")
    for p in ALL_PASSES:
        needs = f" (requires {', '.join(p.requires)})" if p.requires else ""
        row(p.name, "fusion" if p.fusion else "cleanup", p.description + needs)
    click.echo("recipe passes (where the recipe asks for them):")
    for name, description in RECIPE_PASSES.items():
        row(name, "recipe", description)
    for backend in BACKENDS:
        click.echo(f"backend lowering: {backend.name} (when the engine is emitted):")
        lowering = backend.lowering_passes(BuildOptions(), None)
        for p in lowering:
            row(p.name, "fusion" if p.fusion else "lowering", p.description)
        if not lowering:
            click.echo("  (no graph rewrite: the engine's program is written op by op from the optimised graph)")
    ctx.exit(0)


def _quant_options(f):
    """``llmc build``'s quantization flags (llmc.quant.recipe.QuantRecipe), passed on as ``quant_*`` kwargs."""
    options = [
        click.option("--quant", "quant_quant", default="none", show_default=True, metavar="FORMAT",
                     help="Quantize: fp8 | int4 | int4-awq | int4-gptq | nvfp4 (CPU: int4 runs on ONNX Runtime's "
                          "4-bit kernels, fp8/nvfp4 are emulated).  The build reports accuracy against the "
                          "unquantized model in report.json."),
        click.option("--group-size", "quant_group_size", default=128, show_default=True,
                     help="INT4 group size along the input dimension: 32, 64 or 128."),
        click.option("--symmetric", "quant_symmetric", is_flag=True,
                     help="INT4 without zero points (symmetric groups)."),
        click.option("--lm-head", "quant_lm_head", default="int8", show_default=True,
                     type=click.Choice(["int8", "int4", "none"]),
                     help="With int4 formats: how the output projection is stored (none = unquantized)."),
        click.option("--int4-kernel", "quant_int4_kernel", default="llmc", show_default=True,
                     type=click.Choice(["llmc", "mlas"]),
                     help="CPU kernel for INT4 linears: llmc (llmc's Int4MatMul: int8 activations, integer dot "
                          "products, AVX-512 VNNI / AVX2) or mlas (ONNX Runtime's MatMulNBits)."),
        click.option("--int4-accuracy-level", "quant_int4_accuracy_level", default=4, show_default=True,
                     help="With --int4-kernel mlas: MatMulNBits' compute, 4 = int8 activations (fastest), "
                          "1 = fp32."),
        click.option("--kv-cache-dtype", "quant_kv_cache_dtype", default=None, metavar="DTYPE",
                     help="KV cache format: fp16 (half the cache memory and decode reads; native on the CPU) "
                          "or fp8 (per-layer scales from calibration; emulated on the CPU) [default: the "
                          "model's compute dtype]."),
        click.option("--calib-data", "quant_calib_data", default=None, type=click.Path(path_type=Path),
                     help="Calibration text: a plain-text file, or JSONL with a \"text\" field per line "
                          "[default: built-in pydoc text]."),
        click.option("--calib-samples", "quant_calib_samples", default=32, show_default=True,
                     help="Calibration sequences (32 x 256 tokens: more moved the default model's KL by under 1%)."),
        click.option("--calib-seq-len", "quant_calib_seq_len", default=256, show_default=True,
                     help="Tokens per calibration sequence."),
        click.option("--calib-device", "quant_calib_device", default="auto", show_default=True,
                     type=click.Choice(["auto", "cpu", "cuda"]),
                     help="Where calibration's forward and statistics run: auto takes a CUDA device when torch "
                          "sees one (AWQ and GPTQ themselves run on the CPU)."),
        click.option("--calib-seed", "quant_seed", default=0, show_default=True,
                     help="Seed choosing the calibration sequences (same seed, same quantized weights)."),
        click.option("--eval-tokens", "quant_eval_tokens", default=None, type=click.IntRange(min=2), metavar="N",
                     help="Score N held-out tokens in the accuracy report (whole 256-token windows; all the "
                          "held-out text if it has fewer) [default: as many as report the perplexity "
                          "increase to +/-0.25 points (95%), 2048 to 4096]."),
        click.option("--max-ppl-increase", "max_ppl_increase", default=None, type=float, metavar="PCT",
                     help="Fail the build (exit 4) if held-out perplexity rises by more than PCT percent."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@cli.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True,
              help="Engine directory to create (must not exist unless --force).")
@click.option("--print-passes", is_flag=True, expose_value=False, is_eager=True, callback=_print_passes,
              help="List the passes of the pipeline, in order, and exit.")
@click.option("--disable-pass", "disabled_passes", multiple=True, metavar="NAME",
              help="Skip a pass (repeatable); 'all-fusions' skips every fusion. See --print-passes.")
@click.option("--verify-passes", is_flag=True,
              help="Run the graph before and after every pass on random inputs; fail naming the first pass "
                   "that changes the logits beyond 1e-5 relative error.")
@click.option("--target", default="cpu", show_default=True, help="Target to build for (see `llmc targets`).")
@click.option("--gpu", default=None, metavar="NAME",
              help="GPU to build for: a100, l40s, h100, h200, b200, gb200, rtx4090, rtx5090, or auto (the local "
                   "GPU). Builds llmc's CUDA engine here, with no GPU needed (see --engine).")
@click.option("--engine", "engine_kind", type=click.Choice(["cuda", "tensorrt"]), default="cuda", show_default=True,
              help="GPU targets: 'cuda' = llmc's CUDA engine (torch + ahead-of-time Triton kernels + CUDA graphs), "
                   "which `llmc run` executes; 'tensorrt' = a TensorRT export (TensorRT for RTX builds RTX engines "
                   "here; data-centre GPUs need full TensorRT on that GPU).")
@click.option("--dtype", "engine_dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="CUDA engines: the compute dtype of weights and activations.")
@click.option("--max-batch-size", default=None, type=int, metavar="N",
              help="GPU engines: most sequences per step (KV slots)  [default: 16]")
@click.option("--max-num-tokens", default=None, type=int, metavar="N",
              help="GPU engines: most new tokens per step (prefill chunk + decodes)  [default: 2048]")
@click.option("--max-seq-len", default=None, type=int, metavar="N",
              help="GPU engines: longest sequence (prompt + output), the KV slots' length  [default: the model's "
                   "context, at most 8192]")
@click.option("--block-size", default=16, show_default=True, help="KV-cache block size in tokens (power of two).")
@click.option("--tp", default=1, show_default=True, type=int, metavar="N",
              help="CUDA engines: tensor parallelism over N GPUs (1, 2, 4, 8): N rank programs, each with its share "
                   "of the attention heads and MLP columns, joined by an all-reduce.")
@click.option("--ep", is_flag=True,
              help="With --tp N: place MoE experts whole on the N ranks (expert parallelism; E/N experts each) "
                   "instead of splitting every expert's columns.")
@click.option("--mxfp4-activations", type=click.Choice(["float32", "int8"]), default="float32", show_default=True,
              help="MXFP4 checkpoints (gpt-oss), CPU engine: multiply the experts' codes with the activations as "
                   "they are (float32, exact) or quantized to 8 bits per 32 values (int8: llama.cpp's MXFP4 x Q8_0 "
                   "trade, 2-3x faster expert matmuls, not exact; fast with AVX-512 VNNI and VBMI, else a scalar "
                   "loop).")
@click.option("--text-only", is_flag=True,
              help="Vision-language checkpoints (Qwen3.5, Gemma 3/4, Mistral 3, Llama 4, LLaVA, ...): build the "
                   "text model alone from the wrapper's own weights, leaving the encoders out (the manifest records "
                   "it). Without it such a checkpoint is refused until llmc compiles its encoders.")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists (only once the build succeeds).")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Build cache directory [default: $LLMC_CACHE_DIR, else $XDG_CACHE_HOME/llmc or ~/.cache/llmc].")
@click.option("--no-cache", is_flag=True, help="Rebuild even on a cache hit, and replace the cache entry.")
@click.option("--max-memory", default=None, metavar="SIZE",
              help="Most resident memory the build may use, e.g. 8G or 512M: refused up front (exit 5) when the "
                   "build's estimate is larger, the accuracy report's rounds sized to it, and a build that goes past "
                   "it stops with one line (exit 5) [default: the machine's memory; the build stops with one line "
                   "if that runs out].")
@click.option("--lora-slots", default=0, show_default=True, type=int, metavar="S",
              help="Multi-LoRA: S PEFT adapters resident at once, chosen per request at run time (0: no LoRA; "
                   "the engine is exactly as without).")
@click.option("--max-lora-rank", default=16, show_default=True, type=int, metavar="R",
              help="With --lora-slots: the largest adapter rank the engine takes (smaller ones are zero-padded).")
@click.option("--lora-targets", default="q,k,v,o,gate,up,down", show_default=True, metavar="LIST",
              help="With --lora-slots: the linears that take adapters (subset of q,k,v,o,gate,up,down).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object with the result instead of text (no progress lines).")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
@_quant_options
def build(checkpoint: Path, output: Path, disabled_passes: tuple[str, ...], verify_passes: bool, target: str,
          gpu: str | None, engine_kind: str, engine_dtype: str, max_batch_size: int | None,
          max_num_tokens: int | None, max_seq_len: int | None,
          block_size: int, tp: int, ep: bool, mxfp4_activations: str, text_only: bool, force: bool,
          cache_dir: Path | None,
          no_cache: bool,
          max_memory: str | None,
          lora_slots: int, max_lora_rank: int, lora_targets: str,
          as_json: bool, quiet: bool, max_ppl_increase: float | None, **quant_args) -> None:
    """Build an engine from a Hugging Face CHECKPOINT directory.

    Builds go through the build cache: an identical earlier build (same checkpoint bytes, recipe,
    target, toolchain and llmc) is copied to -o instead of rebuilt. See `llmc cache --help`.
    """
    from llmc.compiler.build import BuildOptions, build_cached
    from llmc.quant.recipe import QuantRecipe

    start = time.perf_counter()

    def progress(msg: str) -> None:
        if not quiet and not as_json:  # machines reading --json get the one object, nothing else
            click.echo(f"{msg} (+{time.perf_counter() - start:.1f}s)", err=True)

    quant = {k.removeprefix("quant_"): v for k, v in quant_args.items()}
    if quant["calib_data"] is not None:
        quant["calib_data"] = str(quant["calib_data"])
    target = _gpu_target(gpu, target)
    limit = None
    if max_memory is not None:
        from llmc.memory import parse_size

        try:
            limit = parse_size(max_memory)
        except ValueError as exc:
            raise LlmcError(f"--max-memory {exc}") from None
    options = BuildOptions(target=target, block_size=block_size, force=force, disabled_passes=disabled_passes,
                           verify_passes=verify_passes, quant=QuantRecipe(**quant), max_ppl_increase=max_ppl_increase,
                           max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                           engine=engine_kind, dtype=engine_dtype, max_memory=limit, lora_slots=lora_slots,
                           max_lora_rank=max_lora_rank, tp=tp, ep=ep, mxfp4_activations=mxfp4_activations,
                           text_only=text_only,
                           lora_targets=tuple(t.strip() for t in lora_targets.split(",") if t.strip()))
    try:
        try:
            result = build_cached(checkpoint, output, options, progress=progress, cache_dir=cache_dir,
                                  refresh=no_cache)
        except OSError as exc:
            # What escapes the build cache's own handling is the copy to -o (or the twin's scratch space).
            if os_fault_errno(exc) in (None, errno.ENOENT, errno.ENOTDIR):
                raise
            raise os_fault(exc, output, "writing the engine", elsewhere=f"choose another -o than {output}") from None
    except LlmcError as exc:
        if as_json:  # CI reads stdout: one object on failure too; the error line still goes to stderr
            click.echo(json.dumps({"status": "error", "exit_code": exc.exit_code, "error": str(exc)}))
        raise
    if as_json:
        click.echo(json.dumps(_build_json(result, target)))
    elif not quiet:
        size = sum(f.stat().st_size for f in result.out_dir.rglob("*") if f.is_file())
        how = f"cache hit {result.key[:16]}" if result.cache_hit else f"built, cached as {result.key[:16]}"
        click.echo(f"{result.out_dir} ({size / 2**20:.1f} MiB): {how} in {result.timings['total']:.1f}s")


def _token_ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3`` as a list of ints (the engine checks them against its vocabulary)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        ids = []
    if not ids:
        raise LlmcError(f"--prompt-ids {text!r}: give comma-separated token ids, e.g. --prompt-ids 1,2,3")
    return ids


def _gpu_target(gpu: str | None, target: str) -> str:
    """The target named by ``--gpu`` (``auto``: the local GPU), checked against ``--target``."""
    if gpu is None:
        return target
    from llmc.compiler.targets import TARGETS, detect_gpu

    if target != "cpu":
        raise LlmcError(f"--gpu {gpu} and --target {target}: name the target once (--gpu for GPUs)")
    if gpu == "auto":
        return detect_gpu().name
    if gpu not in TARGETS or TARGETS[gpu].sm is None:
        gpus = ", ".join(n for n, t in TARGETS.items() if t.sm is not None)
        raise LlmcError(f"--gpu {gpu!r}: unknown GPU; choose one of: {gpus}, auto (see `llmc targets`)")
    return gpu


def _build_json(result, target: str) -> dict:
    """The `llmc build --json` object: what a CI step needs to branch on and to record."""
    return {
        "status": "ok",
        "cache_hit": result.cache_hit,
        "key": result.key,
        "artifact": str(result.out_dir),
        "artifact_digest": result.artifact_digest,
        "target": target,
        "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
        "build_timings_s": result.build_info.get("timings_s", {}),
        # Peak resident memory per stage (GB) and the build's estimate and bound, as build_info.json has them.
        "build_memory": result.build_info.get("memory"),
        "accuracy": result.report.get("accuracy"),
        "graph": result.report.get("graph"),
        "passes": result.report.get("passes"),
    }


@cli.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("-p", "--prompt", "prompts", multiple=True,
              help="Prompt text; repeat for several prompts, which run batched together.")
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="IDS",
              help="A prompt as comma-separated token ids (1,2,3); repeatable. Works on any engine, also one "
                   "built without a tokenizer.")
@click.option("-n", "--max-new-tokens", default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling mass (1: off).")
@click.option("--seed", default=None, type=int, help="Sampling seed (reproducible output).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--device", default=None, metavar="DEV",
              help="CUDA engines: cuda (default), cuda:N, or cpu (the same program on torch's CPU ops; slow).")
@click.option("--image", "images", multiple=True, type=click.Path(path_type=Path), metavar="PATH",
              help="An image for a vision-language engine (repeatable): the images go, in order, at the prompt's "
                   "image tokens, or before the prompt where it has none. Every prompt gets them.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: token_ids, text, timings.")
def run(engine: Path, prompts: tuple[str, ...], prompt_ids: tuple[str, ...], max_new_tokens: int,
        temperature: float, top_k: int, top_p: float, seed: int | None, ignore_eos: bool, device: str | None,
        as_json: bool, images: tuple[Path, ...] = ()) -> None:
    """Generate text (or token ids) with an ENGINE directory.

    \b
      llmc run engines/llava --image cat.png --prompt "USER: What is in the picture? ASSISTANT:"
    """
    from llmc.runtime import Engine, SamplingParams

    if bool(prompts) == bool(prompt_ids):
        raise LlmcError("llmc run: give the prompts as text (--prompt) or as token ids (--prompt-ids 1,2,3), "
                        "one of the two")
    inputs: list = list(prompts) or [_token_ids(p) for p in prompt_ids]
    t0 = time.perf_counter()
    eng = Engine.load(engine, device=device)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, ignore_eos=ignore_eos)
    per_prompt = None
    if images:
        inputs = [_with_image_tokens(eng, engine, p, len(images)) for p in inputs]
        per_prompt = [list(images)] * len(inputs)
    t1 = time.perf_counter()
    outs = eng.generate(inputs, params, images=per_prompt)
    gen_s = time.perf_counter() - t1
    n_tokens = sum(len(o.token_ids) for o in outs)
    timings = {"load_s": round(load_s, 4), "generate_s": round(gen_s, 4),
               "ttft_s": round(max(o.ttft for o in outs), 4),
               "tokens_per_s": round(n_tokens / gen_s, 2) if gen_s > 0 else None}
    if as_json:
        # "text" is null for an engine without a tokenizer; "prompt" is the text given, if any.
        items = [{**({"prompt": p} if isinstance(p, str) else {}), "prompt_token_ids": o.prompt_token_ids,
                  "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason}
                 for p, o in zip(inputs, outs, strict=True)]
        obj = dict(items[0]) if len(items) == 1 else {"outputs": items}
        obj["timings"] = timings
        click.echo(json.dumps(obj))
        return
    for p, o in zip(inputs, outs, strict=True):
        if isinstance(p, str):
            click.echo(f"{p}{o.text}")
        else:  # token ids in, token ids out (and the text, where the engine has a tokenizer)
            click.echo(",".join(map(str, o.token_ids)))
            if o.text is not None:
                click.echo(o.text)
        if len(inputs) > 1:
            click.echo("---")
    click.echo(f"[{n_tokens} tokens in {gen_s:.2f}s, {timings['tokens_per_s']} tok/s; "
               f"first token {timings['ttft_s'] * 1000:.0f} ms; load {load_s:.2f}s]", err=True)


def _with_image_tokens(eng, engine: Path, prompt: str | list[int], n: int) -> str | list[int]:
    """``prompt`` with ``n`` image tokens where it has none (before its text; a text prompt gets the token's text,
    so the tokenizer still adds its BOS first). ``--image`` on an engine without an image encoder: one line."""
    if eng.images is None:
        raise LlmcError(f"{engine}: --image: this engine takes no images (a text model, or a vision-language model "
                        "built --text-only); leave --image out")
    token_id = eng.images.placeholder  # the image token, or the family's own placeholder (Gemma 3: start of image)
    if isinstance(prompt, list):
        return prompt if token_id in prompt else [token_id] * n + prompt
    text = eng.tokenizer.id_to_token(token_id) if eng.tokenizer is not None else None
    if text is None or eng.tokenizer.encode(text, add_special_tokens=False) != [token_id]:
        raise LlmcError(f"{engine}: --image: the tokenizer has no text for the image token {token_id}; give the "
                        f"prompt as --prompt-ids with {token_id} where each image goes")
    return prompt if text in prompt else text * n + prompt


@cli.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--integrity-only", is_flag=True,
              help="Check files and schema only, not whether this machine can load the engine.")
def verify(engine: Path, as_json: bool, integrity_only: bool) -> None:
    """Check an ENGINE: every file's sha256, the schema version, and whether this machine can load it
    (backend libraries, kernels, GPU). Exit 1 with the reasons if anything fails."""
    from llmc.runtime import artifact

    result = artifact.check(engine, loadable=not integrity_only)
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        for p in [*result.problems, *result.load_problems]:
            click.echo(f"{engine / p.file}: {p.message}", err=True)
        if result.ok:
            what = "files intact" if integrity_only else "files intact, loadable here"
            click.echo(f"{engine}: ok ({what}; {result.artifact_digest})")
    sys.exit(0 if result.ok else 1)


def _echo_cuda_kernels(engine: Path, manifest: dict) -> None:
    """A CUDA engine's kernels per decoder layer in one decode step, counted on torch's meta device (no GPU, no
    weights read: llmc.runtime.workers.cuda.launches)."""
    if manifest.get("parallel"):
        click.echo("kernels     not counted for tensor-parallel engines")
        return
    try:
        from llmc.runtime.workers.cuda.launches import decode_structure

        structure = decode_structure(engine, manifest, batch=1)
    except Exception as e:  # noqa: BLE001 - inspect shows what it can
        click.echo(f"kernels     not counted: {type(e).__name__}: {e}")
        return
    for line in structure.summary():
        click.echo(line)


def _echo_multimodal(manifest: dict) -> None:
    """A vision-language engine: its wrapper, how it takes images (or that it was built --text-only), and every
    further graph of the artifact (the vision encoder)."""
    mm = manifest.get("multimodal")
    if mm is not None:
        if mm.get("text_only"):
            click.echo(f"multimodal  {mm['wrapper']} built --text-only: text only, encoders left out "
                       f"({', '.join(mm.get('encoders_left_out', []))})")
        else:
            per = mm.get("tokens_per_image") or "by image size"
            click.echo(f"multimodal  {mm['wrapper']}: images through graph {mm.get('encoder_graph')!r}, image token "
                       f"{mm.get('image_token_id')}, tokens per image {per}"
                       + (f", {mm['positions']} positions" if mm.get("positions") else ""))
    for name, g in sorted((manifest.get("graphs") or {}).items()):
        # an ONNX Runtime graph is one file; a CUDA engine's is a program (+ its AOT kernels, in its dtype)
        what = g.get("model_file") or g.get("program_file", "?")
        if g.get("backend") == "cuda":
            what += f" ({g.get('dtype')}, {len(g.get('kernels') or [])} AOT kernels)"
        click.echo(f"  graph     {name}: {g['backend']} {what}, inputs {', '.join(g['inputs'])} → "
                   f"{', '.join(g['outputs'])}")


@cli.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print manifest and report as one JSON object.")
def inspect(engine: Path, as_json: bool) -> None:
    """Show an ENGINE's manifest (source, recipe, target, KV layout) and build report."""
    from llmc.runtime import artifact

    manifest = artifact.read_manifest(engine)
    report_path = engine / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    if as_json:
        click.echo(json.dumps({"manifest": manifest, "report": report}))
        return
    click.echo(f"engine      {engine}")
    click.echo(f"source      {manifest['source']['model_type']} {manifest['source']['digest'][:23]}…")
    click.echo(f"target      {manifest['target']['name']} ({manifest['target']['backend']})")
    click.echo(f"recipe      {json.dumps(manifest['recipe'], sort_keys=True)}")
    kv = manifest["kv_cache"]
    geometry = (f"block {kv['block_size']}" if kv.get("block_size") else  # slot layouts (GPU engines)
                f"{kv.get('max_slots')} slots × {kv.get('max_seq_len')} tokens")
    if kv.get("layers"):  # per-layer geometry (Gemma 4): each distinct shape with its layer count
        from collections import Counter

        shapes = Counter(f"{e['num_kv_heads']} kv heads × {e['head_size']}" for e in kv["layers"]
                         if "num_kv_heads" in e)
        shared = sum(1 for e in kv["layers"] if "shares" in e)
        per = ", ".join(f"{n} layers × {s}" for s, n in shapes.items())
        click.echo(f"kv cache    {kv['layout']} {geometry} {kv['dtype']}, {per}"
                   + (f", {shared} layers reading an earlier layer's cache" if shared else ""))
    else:
        click.echo(f"kv cache    {kv['layout']} {geometry} {kv['dtype']}, {kv['num_layers']} layers × "
                   f"{kv['num_kv_heads']} kv heads × {kv['head_size']}")
    if manifest.get("lora"):
        lo = manifest["lora"]
        click.echo(f"lora        {lo['slots']} slots of rank ≤ {lo['max_rank']} on {','.join(lo['targets'])} "
                   f"({len(lo['modules'])} linears); adapters load at run time")
    par = manifest.get("parallel")
    if par:  # --tp: what each rank holds
        click.echo(f"parallel    tensor {par['tensor']}: {par['heads_per_rank']} heads and "
                   f"{par['kv_heads_per_rank']} kv heads per rank; embeddings {par['embeddings']}, "
                   f"lm_head {par['lm_head']}")
        if par.get("experts"):
            click.echo(f"            experts {par['experts']}" + (f" (expert parallel over {par['expert']})"
                                                                    if par.get("expert") else ""))
        for r in par["ranks"]:
            click.echo(f"  rank {r['rank']}    {r['weights_file']}: {r['weight_bytes']:,} bytes "
                       f"({r['sharded_bytes']:,} of them its share of split weights)")
    if manifest["engine"].get("engine_file"):
        e = manifest["engine"]
        click.echo(f"engine      {e['engine_file']}: {e['builder']['product']} {e['builder']['version']}, "
                   f"sm_{e['sm'].replace('.', '')}, limits {json.dumps(e.get('limits', {}))}")
    _echo_multimodal(manifest)
    tok = report.get("tokenizer")
    if tok is not None:  # engines built before llmc recorded it have no entry
        click.echo(f"tokenizer   {', '.join(tok['files'])}" if tok["text"] else
                   "tokenizer   none: the engine takes token ids (llmc run ENGINE --prompt-ids 1,2,3)")
    g = report.get("graph", {})
    click.echo(f"graph       {g.get('nodes_traced')} nodes traced → {g.get('nodes_final')} final")
    for p in report.get("passes", []):
        stats = ", ".join(f"{k}={v}" for k, v in p.items() if k != "pass")
        click.echo(f"  pass      {p['pass']}: {stats}")
    for name, n in report.get("backend_fusions", {}).items():  # fused while the engine was written
        click.echo(f"  backend   {name}: matches={n}")
    if manifest["engine"].get("backend") == "cuda":
        _echo_cuda_kernels(engine, manifest)
    check = report.get("self_check")
    if check:  # engines built before the self-check existed have none
        twin = check.get("twin_config") or {}
        layers = twin.get("num_hidden_layers") or twin.get("n_layer")
        click.echo(f"self-check  {check.get('result')}" + (f" (a {layers}-layer random twin of this config "
                                                          "against transformers)" if layers else ""))
    sq = report.get("source_quantization")
    if sq:  # the checkpoint arrived quantized: what llmc kept of it (compiler/prequantized*.py)
        count = next((f", {sq[k]} {k.replace('_', ' ')}" for k in ("linears", "tensors", "tensors_dequantized")
                      if k in sq), "")
        click.echo(f"checkpoint  quantized as {sq.get('method')}{count}: "
                   f"{sq.get('kept') or 'dequantized to ' + str(sq.get('dequantized_to'))}")
    q, acc = report.get("quantization"), report.get("accuracy")
    if q:
        emulated = " (emulated on the CPU)" if q.get("emulated_on_cpu") else ""
        click.echo(f"quant       {q['format']} {q.get('algorithm') or ''} group={q.get('group_size')} "
                   f"kv={q.get('kv_cache_dtype') or 'model dtype'}{emulated}")
    if acc:
        click.echo(f"accuracy    perplexity {acc['ppl']:.4f} vs {acc['ppl_reference']:.4f} unquantized "
                   f"({acc['ppl_increase_pct']:+.2f}%), mean KL {acc['kl_mean']:.4g}, top-1 agreement "
                   f"{100 * acc['top1_agreement']:.2f}% ({acc['tokens']} held-out tokens)")
    info_path = engine / artifact.BUILD_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    click.echo(f"timings     {json.dumps(info.get('timings_s', report.get('timings_s', {})))}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def targets(as_json: bool) -> None:
    """List the targets llmc knows: compute capability, memory, native formats, builder, and whether this
    machine can build for each (RTX targets build without a GPU; TensorRT builds on the GPU it targets)."""
    import importlib.util
    from dataclasses import asdict

    from llmc.compiler.targets import TARGETS

    def status(t) -> str:
        if t.backend == "onnxruntime":
            return "builds here"
        from llmc.compiler.backends.tensorrt import BUILDERS

        b = BUILDERS[t.backend]
        if importlib.util.find_spec(b.module) is None:
            return f"needs {b.distribution}" + (" and the GPU" if b.needs_gpu else "")
        return "builds on the GPU itself" if b.needs_gpu else "builds here"

    rows = [{**asdict(t), "builder": t.backend, "status": status(t)} for t in TARGETS.values()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(f"{'name':8} {'builder':13} {'sm':5} {'mem':>5}  {'native formats':25} status")
    for r in rows:
        mem = f"{r['memory_gib']}G" if r["memory_gib"] else "-"
        click.echo(f"{r['name']:8} {r['builder']:13} {r['sm'] or '-':5} {mem:>5}  "
                   f"{','.join(r['native_formats']):25} {r['status']}")


@cli.command()
@click.argument("checkpoint", metavar="CKPT_OR_CONFIG", type=click.Path(path_type=Path))
@click.option("--gpu", required=True, metavar="NAME", help="A GPU of `llmc targets` (h100, h200, b200, ...) or all.")
@click.option("--tp", default="1", show_default=True, metavar="N[,N...]",
              help="Tensor-parallel GPUs; a list (1,2,4,8) plans each.")
@click.option("--quant", default="none", show_default=True, metavar="FORMAT",
              help="none | fp8 | int4 | int4-awq | nvfp4: what the weights are stored as.")
@click.option("--kv-cache-dtype", default=None, metavar="DTYPE", help="fp8 (default: bfloat16).")
@click.option("--max-model-len", type=int, default=None,
              help="Context per sequence for the batch and roofline figures [default: max_position_embeddings, "
                   "at most 32768].")
@click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True,
              help="Fraction of each GPU's memory for weights, activations and KV cache, as Engine.load takes it.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(checkpoint: Path, gpu: str, tp: str, quant: str, kv_cache_dtype: str | None, max_model_len: int | None,
         gpu_memory_utilization: float, as_json: bool) -> None:
    """Plan a deployment from CKPT_OR_CONFIG's config.json alone (no weights read): per-GPU weight bytes by
    tensor class, KV bytes per token, KV tokens that fit, the largest batch, the decode step's HBM roofline and
    the all-reduce bytes per token at each tensor-parallel degree."""
    from llmc.compiler import deploy_plan

    rep = deploy_plan.report(checkpoint, gpu, tp, quant, kv_cache_dtype, max_model_len, gpu_memory_utilization)
    click.echo(json.dumps(rep) if as_json else deploy_plan.render(rep))


_CACHE_DIR_OPTION = click.option(
    "--cache-dir", type=click.Path(path_type=Path), default=None,
    help="Build cache directory [default: $LLMC_CACHE_DIR, else $XDG_CACHE_HOME/llmc or ~/.cache/llmc].")


@cli.group()
def cache() -> None:
    """The build cache: list, prune and remove cached engines.

    \b
      llmc cache ls [--json]
      llmc cache prune --max-size 2G      # drop least-recently-used entries
      llmc cache rm KEY                   # a key prefix of at least 4 hex digits
    """


def _entry_json(e) -> dict:
    return {"key": e.key, "model": e.meta.get("model", {}), "target": e.meta.get("target"),
            "recipe": e.meta.get("key_inputs", {}).get("recipe"), "recipe_summary": e.meta.get("recipe_summary"),
            "size_bytes": e.size_bytes, "last_used": e.last_used, "created": e.meta.get("created"),
            "artifact_digest": e.meta.get("artifact_digest"), "path": str(e.artifact)}


@cache.command("ls")
@_CACHE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the store and its entries.")
def cache_ls(cache_dir: Path | None, as_json: bool) -> None:
    """List cached engines, most recently used first."""
    from llmc.build_cache import Store, format_size

    store = Store(cache_dir)
    entries = store.list()
    stale = store.stale()
    if as_json:
        click.echo(json.dumps({"cache_dir": str(store.root), "entries": [_entry_json(e) for e in entries],
                               "total_bytes": sum(e.size_bytes for e in entries),
                               "stale_tmp": [str(p) for p in stale]}))
        return
    click.echo(f"{'key':16}  {'model':24} {'target':7} {'size':>7}  {'last used':19}  recipe")
    for e in entries:
        model = e.meta.get("model", {})
        name = f"{model.get('name', '?')} ({model.get('model_type', '?')})"
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
        click.echo(f"{e.key[:16]}  {name[:24]:24} {str(e.meta.get('target')):7} {format_size(e.size_bytes):>7}  "
                   f"{used:19}  {e.meta.get('recipe_summary', '')}")
    total = format_size(sum(e.size_bytes for e in entries))
    click.echo(f"{len(entries)} entries, {total} in {store.root}"
               + (f"; {len(stale)} leftovers of killed builds (removed by `llmc cache prune`)" if stale else ""),
               err=True)


@cache.command("prune")
@_CACHE_DIR_OPTION
@click.option("--max-size", required=True, metavar="SIZE",
              help="Keep at most this much (e.g. 500M, 2G; binary units), dropping least-recently-used entries.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: what was removed.")
def cache_prune(cache_dir: Path | None, max_size: str, as_json: bool) -> None:
    """Remove least-recently-used entries until the cache fits in --max-size (and leftovers of killed builds)."""
    from llmc.build_cache import Store, format_size, parse_size

    limit = parse_size(max_size)
    store = Store(cache_dir)
    removed = store.prune(limit)
    kept = store.list()
    if as_json:
        click.echo(json.dumps({"removed": [_entry_json(e) for e in removed],
                               "freed_bytes": sum(e.size_bytes for e in removed),
                               "total_bytes": sum(e.size_bytes for e in kept), "max_bytes": limit}))
        return
    for e in removed:
        click.echo(f"removed {e.key[:16]} ({format_size(e.size_bytes)})")
    click.echo(f"{len(kept)} entries, {format_size(sum(e.size_bytes for e in kept))} kept "
               f"(limit {format_size(limit)})")


@cache.command("rm")
@click.argument("key")
@_CACHE_DIR_OPTION
def cache_rm(key: str, cache_dir: Path | None) -> None:
    """Remove the entry whose key starts with KEY."""
    from llmc.build_cache import Store, format_size

    store = Store(cache_dir)
    entry = store.remove(store.resolve(key))
    click.echo(f"removed {entry.key[:16]} ({format_size(entry.size_bytes)})")


@cli.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True,
              help="Archive to write: *.tar or *.tar.gz.")
@click.option("--force", is_flag=True, help="Replace the archive if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the result.")
def pack(engine: Path, output: Path, force: bool, as_json: bool) -> None:
    """Write a verified ENGINE directory into one reproducible tar archive."""
    from llmc.build_cache.archive import pack as pack_engine

    result = pack_engine(engine, output, force=force)
    if as_json:
        click.echo(json.dumps({"status": "ok", "archive": str(result.archive), "size_bytes": result.size_bytes,
                               "members": result.members, "artifact_digest": result.artifact_digest}))
    else:
        click.echo(f"packed {engine} -> {result.archive} ({result.size_bytes / 2**20:.1f} MiB, "
                   f"{len(result.members)} files)")


@cli.command()
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True,
              help="Engine directory to create (must not exist unless --force).")
@click.option("--force", is_flag=True, help="Replace the directory if it exists (only once the archive verifies).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the result.")
def unpack(archive: Path, output: Path, force: bool, as_json: bool) -> None:
    """Extract an ARCHIVE written by `llmc pack` and verify it. Refuses absolute paths, '..', links and
    device files in the archive."""
    from llmc.build_cache.archive import unpack as unpack_engine

    result = unpack_engine(archive, output, force=force)
    if as_json:
        click.echo(json.dumps({"status": "ok", **result.to_json()}))
    else:
        click.echo(f"unpacked {archive} -> {output}: ok ({result.artifact_digest})")


from llmc.cli.bench_cmd import bench as _bench  # noqa: E402 - `llmc bench` lives in its own module

cli.add_command(_bench)

from llmc.cli.serve_cmd import serve as _serve  # noqa: E402 - `llmc serve` too

cli.add_command(_serve)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="llmc")


if __name__ == "__main__":
    main()
