"""Multi-LoRA: PEFT adapters in an engine built with --lora-slots, chosen per request, several in one batch.

The reference for an adapter request is the same checkpoint with the adapter merged into its weights by PEFT
(``merge_and_unload``): built as an engine, or run by transformers, greedy tokens identical in float32.
Adapters are written by PEFT itself with random A and B (PEFT's own B starts at zero, which would prove nothing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.compiler.build import BuildOptions, build, canonical_recipe
from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime import Engine, SamplingParams

pytest.importorskip("peft")

from llmc.testing.lora import write_merged_checkpoint, write_peft_adapter  # noqa: E402

SLOTS, RANK = 2, 8
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 31, 77], [400, 2, 9, 9, 130, 64], [11, 12, 13]]
MAX_TOKENS = 16
# name -> write_peft_adapter arguments: ranks 2..8 (the engine's R), attention and MLP targets, rsLoRA.
ADAPTERS = {
    "qv": dict(r=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"), seed=1),
    "all-rs": dict(r=8, alpha=16.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"), rslora=True, seed=2),
    "mlp": dict(r=2, alpha=4.0, targets=("o_proj", "gate_proj", "up_proj"), seed=3),
}


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, tiny_llama) -> Path:
    root = tmp_path_factory.mktemp("lora")
    for name, kwargs in ADAPTERS.items():
        write_peft_adapter(tiny_llama, root / name, **kwargs)
    # Every pass checked differentially, the slot inputs random (compiler/verify.py), as the suite's engines are.
    build(tiny_llama, root / "engine", BuildOptions(lora_slots=SLOTS, max_lora_rank=RANK, verify_passes=True))
    return root


@pytest.fixture(scope="module")
def engine(lora_dir) -> Engine:
    return Engine.load(lora_dir / "engine", lora_adapters={n: lora_dir / n for n in ADAPTERS})


def _greedy(engine: Engine, prompts, lora=None) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora=lora)
    return [o.token_ids for o in engine.generate(prompts, params)]


def _transformers_greedy(checkpoint: Path, prompts) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def test_manifest_records_geometry(lora_dir):
    manifest = json.loads((lora_dir / "engine" / "manifest.json").read_text())
    lora = manifest["lora"]
    assert (lora["slots"], lora["max_rank"], lora["slot_input"]) == (SLOTS, RANK, "lora_slots")
    # 2 layers x 7 linears, each with [in, S*R] and [S*R, out] graph inputs (bound at run time, not weights)
    assert len(lora["modules"]) == 14
    q = next(m for m in lora["modules"] if m["module"] == "model.layers.0.self_attn.q_proj")
    assert (q["in_features"], q["out_features"]) == (64, 64)
    import onnx

    graph = onnx.load(lora_dir / "engine" / "model.onnx", load_external_data=False).graph
    inputs = {i.name for i in graph.input}
    assert {"lora_slots", q["a_input"], q["b_input"]} <= inputs
    assert not any(i.name.endswith((".lora_A", ".lora_B")) for i in graph.initializer)
    from llmc.cli.main import cli

    shown = CliRunner().invoke(cli, ["inspect", str(lora_dir / "engine")]).output
    assert f"lora        {SLOTS} slots of rank ≤ {RANK} on q,k,v,o,gate,up,down (14 linears)" in shown


def test_build_without_slots_is_unchanged():
    # The recipe (the cache key) of a build without --lora-slots has no LoRA fields at all.
    recipe = canonical_recipe(BuildOptions())
    assert not any(k.startswith("lora") or k == "max_lora_rank" for k in recipe)
    assert canonical_recipe(BuildOptions(lora_slots=2))["lora_slots"] == 2


def test_adapter_equals_merged_engine(tmp_path, tiny_llama, lora_dir, engine):
    """rsLoRA on all seven linears, rank = the engine's R: the adapter request equals an engine built from the
    merged checkpoint, and differs from the base model."""
    merged = write_merged_checkpoint(tiny_llama, lora_dir / "all-rs", tmp_path / "merged")
    build(merged, tmp_path / "merged-engine", BuildOptions())
    reference = Engine.load(tmp_path / "merged-engine")
    assert _greedy(engine, PROMPTS, "all-rs") == _greedy(reference, PROMPTS)
    assert _greedy(engine, PROMPTS, "all-rs") != _greedy(engine, PROMPTS)


@pytest.mark.parametrize("name", ["qv", "mlp"])
def test_adapter_equals_merged_transformers(tmp_path, tiny_llama, lora_dir, engine, name):
    """Ranks below R (zero-padded), attention-only and MLP-only targets: transformers on the merged weights."""
    merged = write_merged_checkpoint(tiny_llama, lora_dir / name, tmp_path / "merged")
    assert _greedy(engine, PROMPTS, name) == _transformers_greedy(merged, PROMPTS)


def test_mixed_batch_equals_solo(engine):
    """Base, adapter 1 and adapter 2 requests in the same steps each give their solo output."""
    solo = {lora: _greedy(engine, PROMPTS[:1], lora)[0] for lora in (None, "qv", "all-rs")}
    assert len({tuple(v) for v in solo.values()}) == 3
    reqs = [(None, PROMPTS[0]), ("qv", PROMPTS[0]), ("all-rs", PROMPTS[0]), (None, PROMPTS[0])]
    ids = [engine.submit(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora=lora)) for lora, p in reqs]
    mixed_steps = 0
    while engine.has_unfinished():
        engine.step()
        slots = {c.request.lora_slot for c in engine.last_schedule.chunks}
        mixed_steps += len(slots) == 3  # base (0) and both adapters' slots in one step
    assert mixed_steps >= MAX_TOKENS - 1
    for (lora, _), rid in zip(reqs, ids, strict=True):
        assert engine.result(rid).token_ids == solo[lora]


def test_more_adapters_than_slots_wait_evict_and_reload(engine):
    """Three adapters over two slots: the third waits for a slot (never fails), evictions and reloads give the
    same tokens as solo runs, and the slots are free again afterwards."""
    solo = {name: _greedy(engine, PROMPTS[:1], name)[0] for name in ADAPTERS}
    loads = engine.lora.loads
    names = ["qv", "all-rs", "mlp", "qv", "mlp", "all-rs"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora=n) for n in names]
    outs = engine.generate([PROMPTS[0]] * len(names), params)
    assert [o.token_ids for o in outs] == [solo[n] for n in names]
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.lora.loads >= loads + 2  # at least one eviction and reload
    assert engine.lora.holders == [0] * (SLOTS + 1)
    for _ in range(2):  # round after round of eviction: still identical
        assert _greedy(engine, PROMPTS[:1], "mlp")[0] == solo["mlp"]
        assert _greedy(engine, PROMPTS[:1], "qv")[0] == solo["qv"]
        assert _greedy(engine, PROMPTS[:1], "all-rs")[0] == solo["all-rs"]


def test_request_waiting_for_a_slot_lets_others_pass(engine):
    """Both slots held by running requests for two adapters: a request for a third waits (keeping its place),
    a base request and one for a resident adapter behind it start at once; it starts when a slot frees."""
    def submit(lora, n):
        return engine.submit(PROMPTS[0], SamplingParams(max_tokens=n, ignore_eos=True, lora=lora))

    long = [submit("qv", 12), submit("all-rs", 12)]
    engine.step()
    waiting = submit("mlp", 4)
    behind = [submit(None, 4), submit("qv", 4)]
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert set(behind) <= running and waiting not in running
    assert engine.stats().waiting_lora_adapters == ("mlp",)
    assert set(engine.stats().running_lora_adapters) == {"qv", "all-rs"}
    while waiting not in {r.request_id for r in engine.scheduler.running}:
        engine.step()
    assert engine.result(long[0]) is not None
    while engine.has_unfinished():
        engine.step()
    solo = _greedy(engine, PROMPTS[:1], "mlp")[0][:4]
    assert engine.result(waiting).token_ids == solo
    for rid in [*long, *behind]:
        engine.result(rid)


def test_prefix_cache_keyed_by_adapter(engine):
    prompt = list(range(100, 150))  # 3 full blocks of 16
    params = {lora: SamplingParams(max_tokens=4, ignore_eos=True, lora=lora) for lora in (None, "qv")}
    engine.reset_prefix_cache()
    base = engine.generate([prompt], params[None])[0]
    first = engine.generate([prompt], params["qv"])[0]
    again = engine.generate([prompt], params["qv"])[0]
    base_again = engine.generate([prompt], params[None])[0]
    assert first.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    assert again.num_cached_tokens == 48 and base_again.num_cached_tokens == 48
    assert again.token_ids == first.token_ids and base_again.token_ids == base.token_ids


def test_add_remove_at_run_time(lora_dir, engine):
    engine.add_lora("qv-again", lora_dir / "qv")
    assert engine.lora_adapters()["qv-again"] == lora_dir / "qv"
    assert _greedy(engine, PROMPTS[:1], "qv-again") == _greedy(engine, PROMPTS[:1], "qv")
    with pytest.raises(LlmcError, match="already loaded"):
        engine.add_lora("qv-again", lora_dir / "qv")
    rid = engine.submit(PROMPTS[0], SamplingParams(max_tokens=2, lora="qv-again"))
    with pytest.raises(LlmcError, match="requests for it are in the engine"):
        engine.remove_lora("qv-again")
    while engine.has_unfinished():
        engine.step()
    engine.result(rid)
    engine.remove_lora("qv-again")
    with pytest.raises(LlmcError, match="'qv-again' is not loaded"):
        engine.submit(PROMPTS[0], SamplingParams(lora="qv-again"))
    with pytest.raises(LlmcError, match="is not loaded"):
        engine.remove_lora("qv-again")


def _refused(engine: Engine, path: Path, error: type, *needles: str) -> None:
    with pytest.raises(error) as info:
        engine.add_lora("bad", path)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert "bad" not in engine.lora_adapters()


def test_refusals(tmp_path, tiny_llama, lora_dir, engine):
    _refused(engine, write_peft_adapter(tiny_llama, tmp_path / "r16", r=16), UnsupportedError,
             "r=16", "--max-lora-rank 8", "--max-lora-rank 16")
    _refused(engine, write_peft_adapter(tiny_llama, tmp_path / "dora", use_dora=True), UnsupportedError, "use_dora")
    _refused(engine, write_peft_adapter(tiny_llama, tmp_path / "mts", modules_to_save=["lm_head"]), UnsupportedError,
             "modules_to_save")
    _refused(engine, write_peft_adapter(tiny_llama, tmp_path / "head", targets=("lm_head",)), UnsupportedError,
             "lm_head", "no LoRA slots for", "--lora-targets")
    _refused(engine, write_peft_adapter(tiny_llama, tmp_path / "bias", bias="lora_only"), UnsupportedError,
             "bias 'lora_only'", "bias='none'")
    _refused(engine, write_peft_adapter(tiny_llama, tmp_path / "pattern", rank_pattern={"q_proj": 2}),
             UnsupportedError, "rank_pattern")
    # an adapter trained for another model (hidden size 32): shapes that do not fit the base
    from llmc.testing.checkpoints import write_tiny_llama

    other = write_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64, seed=5)
    _refused(engine, write_peft_adapter(other, tmp_path / "other-ad"), LlmcError, "do not fit the base model",
             "expected [4, 64]")
    _refused(engine, tmp_path / "missing", LlmcError, "adapter_config.json", "no such file")
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    _refused(engine, tmp_path / "no-weights", LlmcError, "adapter_model.safetensors", "no such file")
    with pytest.raises(LlmcError, match="not loaded"):
        engine.submit(PROMPTS[0], SamplingParams(lora="nope"))
    for bad in ("", 3):
        with pytest.raises(LlmcError, match="SamplingParams.lora"):
            SamplingParams(lora=bad)


def test_reads_half_precision_adapters(tmp_path, lora_dir, engine):
    """Adapters saved in bfloat16 / float16 (PEFT keeps the model's dtype) are read exactly, then scaled."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from llmc.runtime.lora.adapter import read_adapter

    ref = read_adapter("qv", lora_dir / "qv", engine.lora.spec)
    for dtype in (torch.bfloat16, torch.float16):
        out = tmp_path / str(dtype).split(".")[-1]
        shutil.copytree(lora_dir / "qv", out)
        tensors = load_file(out / "adapter_model.safetensors")
        save_file({k: v.to(dtype) for k, v in tensors.items()}, out / "adapter_model.safetensors")
        got = read_adapter("qv", out, engine.lora.spec)
        assert got.weights.keys() == ref.weights.keys()
        for module, (a, b) in got.weights.items():
            a32 = tensors[f"base_model.model.{module}.lora_A.weight"].to(dtype).float().numpy()
            np.testing.assert_array_equal(a, a32)
            b32 = tensors[f"base_model.model.{module}.lora_B.weight"].to(dtype).float().numpy()
            np.testing.assert_allclose(b, b32 * np.float32(ref.scaling), rtol=1e-7)


def test_engine_without_slots_refuses_adapters(tiny_engine, lora_dir):
    with pytest.raises(UnsupportedError, match="built without LoRA slots.*--lora-slots"):
        Engine.load(tiny_engine, lora_adapters={"qv": lora_dir / "qv"})
    plain = Engine.load(tiny_engine)
    with pytest.raises(UnsupportedError, match="built without LoRA slots"):
        plain.submit([1, 2, 3], SamplingParams(lora="qv"))


@pytest.mark.parametrize("flags, needle", [(["--lora-slots", "100"], "--lora-slots 100"),
                                           (["--lora-slots", "2", "--max-lora-rank", "0"], "--max-lora-rank 0"),
                                           (["--lora-slots", "2", "--lora-targets", "q,lm_head"], "lm_head")])
def test_bad_build_flags(tmp_path, tiny_llama, flags, needle):
    from llmc.cli.main import cli

    result = CliRunner().invoke(cli, ["build", str(tiny_llama), "-o", str(tmp_path / "out"), *flags])
    err = result.stderr if hasattr(result, "stderr") else result.output
    assert result.exit_code == 2, err
    assert needle in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_slot_mask_selects_per_token():
    """The graph's slot selection on its own, against numpy, on fresh random inputs: the rewrite of one
    linear, run by ONNX Runtime with three slots and a mix of slots per token (0 and -1: none)."""
    import onnx_ir as ir
    import onnxruntime as ort

    from llmc.passes.lora import add_lora

    rng = np.random.default_rng(7)
    d_in, d_out, slots, rank, tokens = 12, 10, 3, 4, 9
    w = rng.standard_normal((d_out, d_in)).astype(np.float32)
    x = ir.Value(name="x", shape=ir.Shape([1, "tokens", d_in]), type=ir.TensorType(ir.DataType.FLOAT))
    weight = ir.Value(name="model.layers.0.self_attn.q_proj.weight", shape=ir.Shape([d_out, d_in]),
                      type=ir.TensorType(ir.DataType.FLOAT))
    weight.const_value = ir.tensor(w, name=weight.name)
    t = ir.node("Transpose", [weight], attributes={"perm": [1, 0]})
    mm = ir.node("MatMul", [x, t.outputs[0]])
    out = ir.node("Identity", [mm.outputs[0]])
    out.outputs[0].name = "y"
    graph = ir.Graph([x], [out.outputs[0]], nodes=[t, mm, out], initializers=[weight], opset_imports={"": 23})
    model = ir.Model(graph, ir_version=10)
    geometry = add_lora(model, slots, rank, ("q",))
    site = geometry.sites[0]
    a = rng.standard_normal((d_in, slots * rank)).astype(np.float32)
    b = rng.standard_normal((slots * rank, d_out)).astype(np.float32)
    slot_ids = np.asarray([0, 1, 2, 3, -1, 3, 2, 1, 0], np.int64)
    xs = rng.standard_normal((1, tokens, d_in)).astype(np.float32)
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
    (got,) = session.run(None, {"x": xs, "lora_slots": slot_ids, site.a_input: a, site.b_input: b})
    want = xs[0] @ w.T
    for i, s in enumerate(slot_ids):
        if s >= 1:
            cols = slice((s - 1) * rank, s * rank)
            want[i] += (xs[0, i] @ a[:, cols]) @ b[cols]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


# -- llmc serve ------------------------------------------------------------------------------------------------


def test_serve_lora(lora_dir, engine):
    """/v1/models lists adapters (parent, root), ``model`` picks one, runtime load/unload (400 duplicate, 404
    unknown), and /metrics carries vLLM's lora_requests_info gauge."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from llmc.serve import ServeConfig
    from llmc.testing.http_server import serve_in_thread

    prompt = "The for statement"
    want = {lora: engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, lora=lora))[0].text
            for lora in (None, "qv")}
    assert want[None] != want["qv"]
    with serve_in_thread(engine, ServeConfig(model_name="base", allow_runtime_lora=True)) as server:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"base", *ADAPTERS}
        assert models["qv"].parent == "base" and models["qv"].root == str(lora_dir / "qv")
        assert models["base"].parent is None
        for lora, name in ((None, "base"), ("qv", "qv")):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == want[lora] and out.model == name
        with pytest.raises(openai.NotFoundError, match="'nope' is not served here"):
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)

        def post(route: str, body: dict) -> httpx.Response:
            return httpx.post(f"{server.v1}/{route}", json=body, timeout=30)

        assert post("load_lora_adapter", {"lora_name": "mlp2", "lora_path": str(lora_dir / "mlp")}).status_code == 200
        assert post("load_lora_adapter", {"lora_name": "mlp2", "lora_path": str(lora_dir / "mlp")}).status_code == 400
        bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": str(lora_dir / "nope")})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        chat = client.chat.completions.create(model="mlp2", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.model == "mlp2"
        assert post("unload_lora_adapter", {"lora_name": "mlp2"}).status_code == 200
        assert post("unload_lora_adapter", {"lora_name": "mlp2"}).status_code == 404
        assert "mlp2" not in {m.id for m in client.models.list().data}

        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "llmc:lora_requests_info")
        (sample,) = family.samples
        assert sample.labels["max_lora"] == str(SLOTS)
        assert set(sample.labels) >= {"running_lora_adapters", "waiting_lora_adapters"}
    with serve_in_thread(engine, ServeConfig(model_name="base")) as server:  # runtime routes off by default
        r = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}, timeout=30)
        assert r.status_code == 404


def test_serve_lora_flags():
    from llmc.cli.serve_cmd import _lora_adapters

    assert _lora_adapters(("a=/x", "b=/y")) == {"a": "/x", "b": "/y"}
    for bad, needle in ((("a",), "NAME=PATH"), (("a=/x", "a=/y"), "given twice")):
        with pytest.raises(LlmcError, match=needle):
            _lora_adapters(bad)


# -- the CUDA engine, on torch's CPU ops ----------------------------------------------------------------------


def test_cuda_engine_on_cpu(tiny_llama, lora_dir, engine):
    """The CUDA engine's program (LoraApply nodes, float32) run by torch on the CPU gives the CPU engine's tokens
    for every adapter and the base in one batch; with the AOT shrink/expand kernels launched through the Triton
    interpreter (the GPU's launch path minus the driver) as well."""
    from llmc.runtime.workers.cuda.session import CudaSession

    built = build(tiny_llama, lora_dir / "cuda", BuildOptions(target="h100", dtype="float32", lora_slots=SLOTS,
                                                               max_lora_rank=RANK))
    program = json.loads((lora_dir / "cuda" / "program.json").read_text())
    assert sum(n["op"] == "LoraApply" for n in program["nodes"]) == 14
    assert built.report["backend_fusions"]["lora"] == 14
    names = [None, "qv", "all-rs"]
    want = [_greedy(engine, PROMPTS[:1], n)[0] for n in names]
    cuda = Engine.load(lora_dir / "cuda", device="cpu", lora_adapters={n: lora_dir / n for n in ADAPTERS})
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora=n) for n in names]
    assert [o.token_ids for o in cuda.generate([PROMPTS[0]] * 3, params)] == want
    session = CudaSession(lora_dir / "cuda", cuda.manifest, device="cpu", interpret_kernels=True)
    assert any(k.startswith("lora_shrink") for k, _ in session.kernels)
    cuda._pool = session.allocate_pool(cuda.manifest["kv_cache"], cuda._blocks.num_blocks)
    cuda._session = session
    session.bind_lora(cuda.lora)
    assert [o.token_ids for o in cuda.generate([PROMPTS[0]] * 3, params)] == want


LORA_APPLY_CASES = [  # tokens, parts [(offset, N)], Y's width, activation, rank
    (9, [(0, 32)], 40, 0, 8), (5, [(24, 32)], 100, 0, 16), (300, [(8, 32)], 72, 0, 8),
    (7, [(0, 64), (64, 16), (80, 16)], 96, 0, 16),  # a packed q|k|v: three parts in one node
    (8, [(0, 72), (72, 72)], 144, 1, 8), (260, [(0, 64), (64, 64)], 128, 1, 16),  # gate|up with the SwiGLU
    (6, [(0, 20), (40, 20)], 80, 1, 6), (11, [(0, 40)], 40, 0, 24)]  # ragged widths, ranks not multiples of 16/8


@pytest.mark.parametrize("tokens, parts, width, activation, rank", LORA_APPLY_CASES)
def test_native_lora_apply_op(tokens, parts, width, activation, rank):
    """llmc.LoraApply in llmc's ONNX Runtime library against numpy on fresh random inputs: each token's own slot,
    slots 0 and -1 untouched, the updates at column offsets of a wider (packed) output, up to three parts in one
    node, the SwiGLU of a gate|up projection after them; ranks that take 16- and 8-float vectors and plain loops;
    260-300 tokens take the thread pool."""
    _check_lora_apply(tokens, parts, width, activation, rank)


def test_native_lora_apply_op_every_isa():
    """The same cases on the AVX2 and baseline (x86-64-v2) builds of the kernel (LLMC_LORA_ISA caps the instruction
    set, read once per process: a subprocess each, running only this check)."""
    import inspect
    import subprocess
    import sys

    code = "\n".join(["import numpy as np", inspect.getsource(_check_lora_apply),
                      f"for case in {LORA_APPLY_CASES!r}: _check_lora_apply(*case)"])
    runs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "LLMC_LORA_ISA": isa},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for isa in ("0", "1")]
    for r in runs:
        out, _ = r.communicate(timeout=300)
        assert r.returncode == 0, out[-3000:]


def _check_lora_apply(tokens, parts, width, activation, rank):
    import onnx_ir as ir

    from llmc.plugins.paged_attention import DOMAIN
    from llmc.testing.ort_sessions import native_session

    rng = np.random.default_rng()
    k, slots = 48, 3
    f32 = ir.TensorType(ir.DataType.FLOAT)
    y = ir.Value(name="y", shape=ir.Shape([1, "t", width]), type=f32)
    x = ir.Value(name="x", shape=ir.Shape([1, "t", k]), type=f32)
    s = ir.Value(name="s", shape=ir.Shape(["t"]), type=ir.TensorType(ir.DataType.INT64))
    ab = [(ir.Value(name=f"a{i}", shape=ir.Shape([k, slots * rank]), type=f32),
           ir.Value(name=f"b{i}", shape=ir.Shape([slots * rank, n]), type=f32)) for i, (_, n) in enumerate(parts)]
    inputs = [y, x, *ab[0], s] + [v for pair in ab[1:] for v in pair]
    attrs = {"rank": rank, "offset": parts[0][0], "activation": activation,
             **{f"offset{i}": off for i, (off, _) in enumerate(parts) if i}}
    node = ir.node("LoraApply", inputs, attributes=attrs, domain=DOMAIN)
    node.outputs[0].name, node.outputs[0].type = "out", f32
    model = ir.Model(ir.Graph([y, x, s, *[v for pair in ab for v in pair]], [node.outputs[0]], nodes=[node],
                              opset_imports={"": 23, DOMAIN: 1}), ir_version=10)
    feeds = {"y": rng.standard_normal((1, tokens, width), np.float32),
             "x": rng.standard_normal((1, tokens, k), np.float32),
             "s": rng.integers(-1, slots + 1, tokens).astype(np.int64)}
    for i, (_, n) in enumerate(parts):
        feeds[f"a{i}"] = rng.standard_normal((k, slots * rank), np.float32)
        feeds[f"b{i}"] = rng.standard_normal((slots * rank, n), np.float32)
    (got,) = native_session(ir.serde.serialize_model(model).SerializeToString()).run(None, feeds)
    want = feeds["y"][0].astype(np.float64)
    for t, slot in enumerate(feeds["s"]):
        if slot >= 1:
            cols = slice((slot - 1) * rank, slot * rank)
            for i, (off, n) in enumerate(parts):
                want[t, off: off + n] += (feeds["x"][0, t] @ feeds[f"a{i}"][:, cols]) @ feeds[f"b{i}"][cols]
    if activation:
        g, u = want[:, : width // 2], want[:, width // 2:]
        want = g / (1.0 + np.exp(-g)) * u
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
