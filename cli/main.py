"""``llmc``: build, run, verify and inspect engines.

Exit codes: 0 success; 1 verification found problems; 2 bad input; 3 unsupported request;
4 accuracy gate failed; 70 internal error (a bug: please report it with LLMC_DEBUG=1 output).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import click

from llmc import __version__
from llmc.errors import EXIT_INTERNAL, LlmcError


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
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if os.environ.get("LLMC_DEBUG"):
                traceback.print_exc()
            click.echo(f"internal error: {type(exc).__name__}: {exc} (rerun with LLMC_DEBUG=1 and report it)",
                       err=True)
            sys.exit(EXIT_INTERNAL)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmc")
def cli() -> None:
    """llmc: compile a Hugging Face checkpoint ahead of time into an engine, then run it.

    \b
      llmc build ./ckpt --target cpu -o engines/m     # checkpoint -> engine artifact
      llmc run engines/m --prompt "Hello"             # generate
      llmc verify engines/m                           # integrity check
      llmc inspect engines/m                          # manifest and report
      llmc targets                                    # what can be built
    """


def _print_passes(ctx: click.Context, _param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from llmc.passes.registry import ALL_PASSES

    for p in ALL_PASSES:
        needs = f" (requires {', '.join(p.requires)})" if p.requires else ""
        click.echo(f"{p.name:24} {'fusion' if p.fusion else 'cleanup':8} {p.description}{needs}")
    ctx.exit(0)


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
@click.option("--block-size", default=16, show_default=True, help="KV-cache block size in tokens (power of two).")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists (only once the build succeeds).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the result instead of text.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def build(checkpoint: Path, output: Path, disabled_passes: tuple[str, ...], verify_passes: bool, target: str,
          block_size: int, force: bool, as_json: bool, quiet: bool) -> None:
    """Build an engine from a Hugging Face CHECKPOINT directory."""
    from llmc.compiler.build import BuildOptions
    from llmc.compiler.build import build as run_build

    start = time.perf_counter()

    def progress(msg: str) -> None:
        if not quiet:
            click.echo(f"{msg} (+{time.perf_counter() - start:.1f}s)", err=True)

    options = BuildOptions(target=target, block_size=block_size, force=force, disabled_passes=disabled_passes,
                           verify_passes=verify_passes)
    result = run_build(checkpoint, output, options, progress=progress)
    if as_json:
        click.echo(json.dumps({
            "status": "ok",
            "artifact": str(result.out_dir),
            "target": target,
            "timings_s": result.report["timings_s"],
            "graph": result.report["graph"],
            "passes": result.report["passes"],
        }))
    elif not quiet:
        size = sum(f.stat().st_size for f in result.out_dir.rglob("*") if f.is_file())
        click.echo(f"built {result.out_dir} ({size / 2**20:.1f} MiB) in {result.timings['total']:.1f}s")


@cli.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("-p", "--prompt", "prompts", multiple=True, required=True,
              help="Prompt text; repeat for several prompts, which run batched together.")
@click.option("-n", "--max-new-tokens", default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling mass (1: off).")
@click.option("--seed", default=None, type=int, help="Sampling seed (reproducible output).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: token_ids, text, timings.")
def run(engine: Path, prompts: tuple[str, ...], max_new_tokens: int, temperature: float, top_k: int,
        top_p: float, seed: int | None, ignore_eos: bool, as_json: bool) -> None:
    """Generate text with an ENGINE directory."""
    from llmc.runtime import Engine, SamplingParams

    t0 = time.perf_counter()
    eng = Engine.load(engine)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, ignore_eos=ignore_eos)
    t1 = time.perf_counter()
    outs = eng.generate(list(prompts), params)
    gen_s = time.perf_counter() - t1
    n_tokens = sum(len(o.token_ids) for o in outs)
    timings = {"load_s": round(load_s, 4), "generate_s": round(gen_s, 4),
               "ttft_s": round(max(o.ttft for o in outs), 4),
               "tokens_per_s": round(n_tokens / gen_s, 2) if gen_s > 0 else None}
    if as_json:
        items = [{"prompt": p, "prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids, "text": o.text,
                  "finish_reason": o.finish_reason} for p, o in zip(prompts, outs, strict=True)]
        obj = dict(items[0]) if len(items) == 1 else {"outputs": items}
        obj["timings"] = timings
        click.echo(json.dumps(obj))
        return
    for p, o in zip(prompts, outs, strict=True):
        click.echo(f"{p}{o.text}")
        if len(prompts) > 1:
            click.echo("---")
    click.echo(f"[{n_tokens} tokens in {gen_s:.2f}s, {timings['tokens_per_s']} tok/s; "
               f"first token {timings['ttft_s'] * 1000:.0f} ms; load {load_s:.2f}s]", err=True)


@cli.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(engine: Path, as_json: bool) -> None:
    """Check an ENGINE's files against its manifest (exit 1 if any is missing or modified)."""
    from llmc.runtime import artifact

    problems = artifact.verify(engine)
    if as_json:
        click.echo(json.dumps({"ok": not problems, "problems": [str(p) for p in problems]}))
    else:
        for p in problems:
            click.echo(f"{engine / p.file}: {p.message}", err=True)
        if not problems:
            click.echo(f"{engine}: ok")
    sys.exit(1 if problems else 0)


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
    click.echo(f"kv cache    {kv['layout']} block {kv['block_size']} {kv['dtype']}, {kv['num_layers']} layers × "
               f"{kv['num_kv_heads']} kv heads × {kv['head_size']}")
    g = report.get("graph", {})
    click.echo(f"graph       {g.get('nodes_traced')} nodes traced → {g.get('nodes_final')} final")
    for p in report.get("passes", []):
        stats = ", ".join(f"{k}={v}" for k, v in p.items() if k != "pass")
        click.echo(f"  pass      {p['pass']}: {stats}")
    click.echo(f"timings     {json.dumps(report.get('timings_s', {}))}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def targets(as_json: bool) -> None:
    """List the targets llmc knows, their compute capability and formats."""
    from dataclasses import asdict

    from llmc.compiler.targets import TARGETS

    if as_json:
        click.echo(json.dumps([asdict(t) for t in TARGETS.values()]))
        return
    click.echo(f"{'name':9} {'backend':13} {'sm':5} {'mem':>5}  {'formats':28} status")
    for t in TARGETS.values():
        mem = f"{t.memory_gib}G" if t.memory_gib else "-"
        status = "available" if t.available else "planned"
        click.echo(f"{t.name:9} {t.backend:13} {t.sm or '-':5} {mem:>5}  {','.join(t.native_formats):28} {status}")


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="llmc")


if __name__ == "__main__":
    main()
