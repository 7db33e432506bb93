"""Tensor parallelism with no GPU: ``llmc build --gpu h100 --tp N`` engines run with ``device="cpu"``, their
ranks in worker processes joined by gloo, and are held to the same engine built with one rank (fp32: identical
greedy tokens, logits within 1e-5).

The builds skip the AOT kernels (they play no part on the CPU) and the self-check (tests/test_cuda_engine.py
runs it for these families), to keep the file short.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.compiler.build import BuildOptions, build
from llmc.errors import UnsupportedError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.workers.cuda.tensor_parallel import TensorParallelError, all_gather_reference, all_reduce_reference

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _trace_each_checkpoint_once():
    """Every build here of one checkpoint (tp=1, 2, 4, --ep, each recipe) starts from the same traced graph: trace
    it once (torch.export is most of a tiny build's time) and give each build its own copy (the passes rewrite the
    graph in place). The tp=1 and tp=N engines then differ by the sharding pass alone."""
    import dataclasses

    from llmc.compiler import frontend

    trace, done = frontend.trace, {}

    def once(checkpoint, compute_dtype="float32", **kwargs):  # kwargs: the trace's image size (none here)
        key = (str(checkpoint.path), compute_dtype, tuple(sorted(kwargs.items())))
        if key not in done:
            done[key] = trace(checkpoint, compute_dtype, **kwargs)
        return dataclasses.replace(done[key], model=done[key].model.clone())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frontend, "trace", once)
        yield


def _build(ckpt, out, tp: int, **kw):
    return build(ckpt, out, BuildOptions(target="h100", dtype="float32", aot_kernels=False, self_check=False,
                                         tp=tp, **kw))


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 512, n).tolist() for n in (3, 20, 45)]  # past the fixtures' sliding window of 24


def _logits(engine: Engine, ids: list[int]) -> np.ndarray:
    """Every position's logits of one prompt (the session's step API; Engine.score asks sessions for state)."""
    n = len(ids)
    blocks = -(-n // engine.block_size)
    feeds = {"input_ids": np.asarray(ids, np.int64), "positions": np.arange(n, dtype=np.int64),
             "slot_mapping": np.arange(n, dtype=np.int64), "block_tables": np.arange(blocks, dtype=np.int64)[None],
             "context_lens": np.asarray([n], np.int64), "query_start_loc": np.asarray([0, n], np.int64),
             "logits_indices": np.arange(n, dtype=np.int64)}
    return engine._session.run(feeds, engine._pool)


@pytest.fixture(scope="module")
def llama_engines(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("tp")
    return {tp: _build(tiny_llama, out / f"tp{tp}", tp).out_dir for tp in (1, 2, 4)}


def test_all_reduce_reference_matches_gloo():
    """The op's reference (the sum of the ranks' partials) against gloo's all-reduce, on fresh random inputs."""
    from datetime import timedelta

    import torch.distributed as dist

    parts = [torch.randn(5, 7) for _ in range(1)]
    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    x = parts[0].clone()
    group.allreduce([x]).wait()
    torch.testing.assert_close(x, all_reduce_reference(parts), rtol=0, atol=0)
    many = [torch.randn(3, 4) for _ in range(4)]
    torch.testing.assert_close(all_reduce_reference(many), torch.stack(many).sum(0), rtol=1e-6, atol=1e-6)
    # AllGather (the vocab-parallel LM head's logits): gloo's all-gather of one rank, and the reference's order
    outs = [torch.empty(5, 7)]
    group.allgather([outs], [parts[0]]).wait()
    torch.testing.assert_close(outs[0], all_gather_reference(parts), rtol=0, atol=0)
    torch.testing.assert_close(all_gather_reference(many), torch.cat(many, dim=-1), rtol=0, atol=0)


def test_ops_deepseek_programs_use_match_onnx_reference():
    """The ops the CUDA engine runs DeepSeek-V3 with (its grouped router: Shape, ConstantOfShape, ScatterElements,
    GatherElements; the frontend's V padding: Pad) against ONNX's reference evaluator on fresh random inputs."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from llmc.runtime.workers.cuda.ops import OPS

    rng = np.random.default_rng()
    x = rng.standard_normal((5, 8)).astype(np.float32)
    idx = rng.integers(-8, 8, (5, 3)).astype(np.int64)

    def ref(op, inputs, attrs=None, n_out=1, **consts):
        names = [f"i{k}" for k in range(len(inputs))]
        nodes = [helper.make_node("Constant", [], [k], value=helper.make_tensor(k, TensorProto.INT64, v.shape, v))
                 for k, v in consts.items()]
        nodes.append(helper.make_node(op, names + list(consts), [f"o{k}" for k in range(n_out)], **(attrs or {})))
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(
            v.dtype), v.shape) for n, v in zip(names, inputs, strict=True)],
            [helper.make_tensor_value_info(f"o{k}", TensorProto.UNDEFINED, None) for k in range(n_out)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        return ReferenceEvaluator(onnx.shape_inference.infer_shapes(model)).run(None, dict(zip(names, inputs,
                                                                                              strict=True)))

    t = torch.from_numpy
    np.testing.assert_array_equal(OPS["Shape"](t(x), start=1)[0].numpy(), ref("Shape", [x], {"start": 1})[0])
    shape = np.asarray([3, 2], np.int64)
    np.testing.assert_array_equal(OPS["ConstantOfShape"](t(shape), value=[1.5], dtype="float32")[0].numpy(),
                                  ref("ConstantOfShape", [shape], {"value": helper.make_tensor("v", TensorProto.FLOAT,
                                                                                               [1], [1.5])})[0])
    np.testing.assert_array_equal(OPS["GatherElements"](t(x), t(idx), axis=1)[0].numpy(),
                                  ref("GatherElements", [x, idx], {"axis": 1})[0])
    updates = rng.standard_normal((5, 3)).astype(np.float32)
    unique = np.stack([rng.permutation(8)[:3] for _ in range(5)]).astype(np.int64)  # no duplicate targets
    for u in (updates, np.ones((5, 3), np.float32)):  # a fill from the host is scattered as a scalar
        got = OPS["ScatterElements"](t(x), t(unique), t(u), axis=1)[0].numpy()
        np.testing.assert_array_equal(got, ref("ScatterElements", [x, unique, u], {"axis": 1})[0])
    y = rng.standard_normal((1, 4, 3, 16)).astype(np.float32)
    pads = np.asarray([0, 0, 0, 0, 0, 0, 0, 8], np.int64)
    np.testing.assert_array_equal(OPS["Pad"](t(y), pads.tolist())[0].numpy(), ref("Pad", [y], pads=pads)[0])


def test_llama_tp2_and_tp4_equal_tp1(llama_engines):
    """llama (4 heads, 2 KV heads): tp=2 splits the KV heads, tp=4 replicates each on two ranks; greedy tokens
    identical to tp=1 (batched and alone), logits within 1e-5."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    prompts = _prompts(seed)
    one = Engine.load(llama_engines[1], device="cpu")
    want = [o.token_ids for o in one.generate(prompts, PARAMS)]
    ref = _logits(one, prompts[2])
    for tp in (2, 4):
        eng = Engine.load(llama_engines[tp], device="cpu")
        par = eng.manifest["parallel"]
        assert par["tensor"] == tp and par["heads_per_rank"] == 4 // tp
        assert par["kv_heads_per_rank"] == 1 and par["kv_head_replicas"] == tp // 2
        assert [o.token_ids for o in eng.generate(prompts, PARAMS)] == want, f"tp={tp} seed {seed}"
        assert [eng.generate([p], PARAMS)[0].token_ids for p in prompts] == want, f"tp={tp} seed {seed}"
        np.testing.assert_allclose(_logits(eng, prompts[2]), ref, rtol=0, atol=1e-5)
        eng._session.close()


def test_each_rank_holds_one_nth_of_the_split_weights(llama_engines):
    """Each rank's share of the sharded tensors is 1/N of them (within 2%): at tp=2 all of them; at tp=4 all but
    the packed Q/K/V, whose K and V columns are replicated on two ranks (16 of 64 Q columns, 16 of 32 K and V:
    48 of 128). The rank files hold that plus the replicated weights; the manifest names them with their sha256."""
    from safetensors import safe_open

    with safe_open(str(llama_engines[1] / "weights.safetensors"), "np") as f:
        full = {k: f.get_tensor(k).nbytes for k in f.keys()}  # noqa: SIM118
    for tp in (2, 4):
        root = llama_engines[tp]
        manifest = json.loads((root / "manifest.json").read_text())
        ranks = manifest["parallel"]["ranks"]
        assert len(ranks) == tp and not (root / "weights.safetensors").exists()
        for r in ranks:
            assert r["weights_file"] in manifest["files"] and r["program_file"] in manifest["files"]
            with safe_open(str(root / r["weights_file"]), "np") as f:
                cut = {k.split("@shard")[0]: f.get_tensor(k).nbytes for k in f.keys() if "@shard" in k}  # noqa: SIM118
                whole = {k: f.get_tensor(k).nbytes for k in f.keys() if "@" not in k}  # noqa: SIM118
            assert sum(cut.values()) == r["sharded_bytes"] and set(cut) <= set(full)
            assert all(whole[k] == full[k] for k in whole)  # replicated: as in the one-rank engine
            qkv = {k for k in cut if "k_proj" in k}
            # 2 layers x (Q/K/V, o_proj, gate/up, down_proj), the embedding table and the LM head (vocab-parallel)
            assert len(qkv) == 2 and len(cut) == 10 and {"model.embed_tokens.weight", "lm_head.weight.T"} <= set(cut)
            if tp == 4:
                for k in qkv:
                    assert cut[k] / full[k] == pytest.approx(48 / 128, rel=0.02)
            rest = set(cut) - (qkv if tp == 4 else set())
            share = sum(cut[k] for k in rest) / sum(full[k] for k in rest)
            assert share == pytest.approx(1 / tp, rel=0.02), (tp, r["rank"], share)
            assert sum(full[k] for k in cut) > 0.5 * sum(full.values())  # the split tensors are most of the model


@pytest.fixture(scope="module")
def family_engine(tmp_path_factory, family_checkpoint, family_cuda_engine):
    """``family_engine(model_type, tp, ep=False) -> engine dir``, each built once per module (the tp=1 engine is
    shared by the tensor- and expert-parallel tests of a family, and is the session's: tests/conftest.py, the
    engine tests/test_cuda_engine.py holds to transformers, built with these options)."""
    built: dict = {}

    def get(model_type: str, tp: int, ep: bool = False):
        key = (model_type, tp, ep)
        if tp == 1 and not ep:
            return family_cuda_engine(model_type)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tp-{model_type}-{tp}{'-ep' if ep else ''}")
            built[key] = _build(family_checkpoint(model_type), out / "engine", tp, ep=ep).out_dir
        return built[key]
    return get


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "mixtral", "qwen2"])
def test_families_tp2_equal_tp1(model_type, family_engine):
    """qwen3 (per-head q/k norms), gemma3 (sliding window, GeGLU, norms after each block), mixtral (MoE: each
    expert's gate/up columns and down rows split, router replicated, one all-reduce of the weighted sum), qwen2
    (Q/K/V biases, cut with their columns): tp=2 = tp=1."""
    one = Engine.load(family_engine(model_type, 1), device="cpu")
    two = Engine.load(family_engine(model_type, 2), device="cpu")
    seed = int(np.random.SeedSequence().entropy % 2**31)
    prompts = _prompts(seed)
    assert [o.token_ids for o in two.generate(prompts, PARAMS)] == [o.token_ids for o in
                                                                   one.generate(prompts, PARAMS)], seed
    np.testing.assert_allclose(_logits(two, prompts[2]), _logits(one, prompts[2]), rtol=0, atol=1e-5)
    two._session.close()


@pytest.fixture(scope="module")
def deepseek_engines(tmp_path_factory):
    """The deepseek_v3 fixture tests/test_mechanisms.py builds (MLA with a q LoRA, one dense layer, one layer of 8
    routed experts in 2 groups beside a shared expert), at tp=1 and tp=2."""
    from llmc.testing.tried_families import write_tried_family

    out = tmp_path_factory.mktemp("tp-deepseek")
    ckpt = write_tried_family("deepseek_v3", out / "ckpt")
    return {tp: _build(ckpt, out / f"tp{tp}", tp).out_dir for tp in (1, 2)}


def test_deepseek_v3_mla_tp2_equals_tp1(deepseek_engines):
    """Multi-head latent attention split by heads (q_b_proj and kv_b_proj columns, o_proj rows; the latent
    projections, their norms and the rotary key replicated), the dense MLP and the shared expert by columns, the
    routed experts by their intermediate columns, the shared expert's partial sum joining the experts' all-reduce:
    greedy tokens identical to tp=1, logits within 1e-5; each split tensor is halved, the latent kept whole."""
    from safetensors import safe_open

    one = Engine.load(deepseek_engines[1], device="cpu")
    two = Engine.load(deepseek_engines[2], device="cpu")
    seed = int(np.random.SeedSequence().entropy % 2**31)
    prompts = _prompts(seed)
    assert [o.token_ids for o in two.generate(prompts, PARAMS)] == [o.token_ids for o in
                                                                   one.generate(prompts, PARAMS)], seed
    np.testing.assert_allclose(_logits(two, prompts[2]), _logits(one, prompts[2]), rtol=0, atol=1e-5)
    two._session.close()
    par = two.manifest["parallel"]
    assert par["heads_per_rank"] == 2 and "latent" in par["attention"] and "shared_experts" in par
    spec = json.loads((deepseek_engines[2] / "rank1" / "program.json").read_text())
    ops = [n["op"] for n in spec["nodes"]]
    # per layer: attention, then MLP or experts; one after the vocab-parallel embedding lookup; the logits gathered
    assert ops.count("AllReduce") == 5 and ops.count("AllGather") == 1
    with safe_open(str(deepseek_engines[1] / "weights.safetensors"), "np") as f:
        full = {k: f.get_tensor(k).nbytes for k in f.keys()}  # noqa: SIM118
    with safe_open(str(deepseek_engines[2] / "rank1" / "weights.safetensors"), "np") as f:
        cut = {k.split("@shard")[0]: f.get_tensor(k).nbytes for k in f.keys() if "@shard" in k}  # noqa: SIM118
        whole = {k for k in f.keys() if "@" not in k}  # noqa: SIM118
    for k, n in cut.items():
        assert n / full[k] == pytest.approx(0.5, rel=0.02), k
    names = " ".join(cut)
    for proj in ("q_b_proj", "kv_b_proj", "o_proj", "shared_experts.down_proj", "experts.gate_up_proj"):
        assert proj in names
    assert any("kv_a_proj_with_mqa" in k for k in whole) and "kv_a_proj" not in names
    # `llmc plan`'s per-GPU weight bytes (bfloat16) are this engine's (float32) float tensors, halved: within the
    # rotary frequencies and scalar constants the plan does not count (28 B here)
    from llmc.compiler.deploy_plan import model_from_config, weight_bytes

    with safe_open(str(deepseek_engines[2] / "rank1" / "weights.safetensors"), "np") as f:
        floats = sum(f.get_tensor(k).nbytes for k in f.keys() if f.get_tensor(k).dtype.kind == "f")  # noqa: SIM118
    model = model_from_config(json.loads((deepseek_engines[2] / "hf_config.json").read_text()), "hf_config.json")
    assert 0 <= floats - 2 * sum(weight_bytes(model, 2, "none").values()) < 64


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_expert_parallel_tp2_equals_tp1(model_type, family_engine):
    """--tp 2 --ep: each rank holds 2 of the 4 experts whole (rows of the [E, ...] expert tensors), the router
    replicated, ids localised and other ranks' pairs zeroed, the weighted sums all-reduced: greedy tokens identical
    to tp=1, logits within 1e-5."""
    from safetensors import safe_open

    one = Engine.load(family_engine(model_type, 1), device="cpu")
    root = family_engine(model_type, 2, ep=True)
    two = Engine.load(root, device="cpu")
    seed = int(np.random.SeedSequence().entropy % 2**31)
    prompts = _prompts(seed)
    assert [o.token_ids for o in two.generate(prompts, PARAMS)] == [o.token_ids for o in
                                                                   one.generate(prompts, PARAMS)], seed
    np.testing.assert_allclose(_logits(two, prompts[2]), _logits(one, prompts[2]), rtol=0, atol=1e-5)
    two._session.close()
    assert two.manifest["parallel"]["expert"] == 2 and "whole experts" in two.manifest["parallel"]["experts"]
    r = CliRunner().invoke(cli, ["inspect", str(root)])
    assert r.exit_code == 0 and "experts whole experts partitioned" in r.output and "expert parallel over 2" in r.output
    with safe_open(str(family_engine(model_type, 1) / "weights.safetensors"), "np") as f:
        full = {k: f.get_tensor(k) for k in f.keys() if "experts" in k}  # noqa: SIM118
    for r in (0, 1):
        with safe_open(str(root / f"rank{r}" / "weights.safetensors"), "np") as f:
            mine = {k.split("@shard")[0]: f.get_tensor(k) for k in f.keys() if "@shard" in k and k.split(  # noqa: SIM118
                "@shard")[0] in full}
        assert mine and set(mine) == set(full)
        for k, w in mine.items():  # experts 2r and 2r + 1, whole
            np.testing.assert_array_equal(w, full[k][2 * r:2 * r + 2])


def test_a_killed_worker_ends_the_requests_with_an_error(llama_engines):
    """SIGKILL a rank mid-generation: the next step raises TensorParallelError naming the rank within seconds
    (never a hang), and every later step says the same."""
    eng = Engine.load(llama_engines[2], device="cpu")
    eng.submit(list(range(5, 30)), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    pid = eng._session.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"rank 1 .*pid {pid}"):
        for _ in range(200):
            eng.step()
    assert time.monotonic() - t0 < 10
    with pytest.raises(TensorParallelError, match="cannot run another step"):
        eng.step()


def test_refusals_before_any_work(tmp_path, tiny_llama):
    from llmc.compiler import sharding

    runner = CliRunner()
    r = runner.invoke(cli, ["build", str(tiny_llama), "-o", str(tmp_path / "a"), "--target", "cpu", "--tp", "2"])
    assert r.exit_code == 3 and "--tp 2 with --target cpu" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(cli, ["build", str(tiny_llama), "-o", str(tmp_path / "b"), "--gpu", "h100", "--tp", "3"])
    assert r.exit_code != 0 and "1, 2, 4 or 8" in r.stderr
    with pytest.raises(UnsupportedError, match="num_key_value_heads 2 .* 8 ranks|num_attention_heads 4"):
        _build(tiny_llama, tmp_path / "c", 8)
    from llmc.quant.recipe import QuantRecipe

    with pytest.raises(UnsupportedError, match=r"intermediate_size \(down_proj's inputs\) 176 gives each rank 88"):
        _build(tiny_llama, tmp_path / "c", 2, quant=QuantRecipe(quant="int4", group_size=32))
    r = runner.invoke(cli, ["build", str(tiny_llama), "-o", str(tmp_path / "d"), "--gpu", "h100", "--ep"])
    assert r.exit_code == 2 and "give --tp N" in r.stderr
    with pytest.raises(UnsupportedError, match="--ep: model_type 'llama' has no mixture-of-experts"):
        _build(tiny_llama, tmp_path / "d", 2, ep=True)
    with pytest.raises(UnsupportedError, match="--tp 8 --ep: 4 experts per layer do not partition evenly"):
        sharding.check_config({"model_type": "mixtral", "num_attention_heads": 8, "num_local_experts": 4}, 8,
                              "config.json", ep=True)
    with pytest.raises(UnsupportedError, match="model_type 'gpt2' is not split across ranks yet"):
        sharding.check_config({"model_type": "gpt2", "num_attention_heads": 4}, 2, "config.json")
    gated = {"model_type": "qwen2_moe", "num_attention_heads": 4, "shared_expert_intermediate_size": 64}
    with pytest.raises(UnsupportedError, match="model_type 'qwen2_moe' is not split"):
        sharding.check_config(gated, 2, "config.json")
    mla = {"model_type": "deepseek_v3", "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
           "v_head_dim": 24, "head_dim": 8, "intermediate_size": 128, "moe_intermediate_size": 32,
           "n_shared_experts": 1}
    sharding.check_config(mla, 2, "config.json")  # MLA splits; o_proj reads 4 x v_head_dim 24, not x head_dim
    with pytest.raises(UnsupportedError, match=r"num_attention_heads x v_head_dim \(o_proj's inputs\) 96 gives "):
        sharding.check_config(mla, 2, "config.json", int4_group=32)
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_cli_inspect_verify_and_run_a_tp_engine(llama_engines):
    runner = CliRunner()
    root = llama_engines[2]
    r = runner.invoke(cli, ["inspect", str(root)])
    assert r.exit_code == 0, r.output
    assert "parallel    tensor 2" in r.output and "rank 1    rank1/weights.safetensors" in r.output
    r = runner.invoke(cli, ["verify", str(root)])
    assert r.exit_code == 1 and "2 GPUs" in r.stderr
    r = runner.invoke(cli, ["run", str(root), "--device", "cpu", "--prompt-ids", "5,17,33,90", "-n", "8", "--json"])
    assert r.exit_code == 0, r.output
    one = Engine.load(llama_engines[1], device="cpu")
    want = one.generate([[5, 17, 33, 90]], SamplingParams(max_tokens=8))[0].token_ids
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] in (want, [want])


def test_the_server_loop_fails_requests_and_health_when_a_worker_dies(llama_engines):
    """`llmc serve`'s step loop over a tp engine: a SIGKILLed rank ends the in-flight request with the
    TensorParallelError and /health's check turns unhealthy naming it, within seconds."""
    import asyncio

    from llmc.serve.loop import EngineLoop

    eng = Engine.load(llama_engines[2], device="cpu")
    loop = EngineLoop(eng, max_queue=8)

    async def go():
        loop.start(asyncio.get_running_loop())
        sink = await loop.submit([list(range(5, 30))], [SamplingParams(max_tokens=400, ignore_eos=True)], ["r"],
                                 time.perf_counter())
        first = await asyncio.wait_for(sink.get(), 30)
        assert first.error is None
        os.kill(eng._session.worker_pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            d = await asyncio.wait_for(sink.get(), 10)
            if d.error is not None or d.final is not None:
                return d, time.monotonic() - t0

    d, seconds = asyncio.run(go())
    assert isinstance(d.error, TensorParallelError) and "rank 1" in str(d.error) and seconds < 10
    ok, why = loop.health()
    assert not ok and "TensorParallelError" in why
    loop.stop()


@pytest.mark.parametrize(("quant", "model_type"), [("fp8", "llama"), ("int4", "qwen3")])
def test_quantized_tp2_equals_tp1_of_the_same_recipe(quant, model_type, family_checkpoint, tiny_llama, tmp_path):
    """FP8 (E4M3 weights with per-channel scales: a column's scale goes with it; row splits keep the scales
    whole) and INT4 (groups of 32 along K: a rank's rows are whole groups) tp=2 engines against tp=1 of the
    same recipe. INT4 is weight-only: logits within 1e-5 (measured 2.9e-6). FP8 also quantizes every linear's
    input to E4M3 with a static scale, so the ~1e-7 float differences of a split sum flip the rounding of an
    activation now and then, and that one step of E4M3 (6%) moves the logits: bound 2e-2 x max |logit|
    (measured 0 on some prompts, 5.0e-3 of 2.7 on others); greedy tokens compared on fixed prompts."""
    from llmc.quant.recipe import QuantRecipe

    ckpt = tiny_llama if model_type == "llama" else family_checkpoint(model_type)
    recipe = QuantRecipe(quant=quant, group_size=32, calib_samples=4, calib_seq_len=64, eval_tokens=256)
    one = Engine.load(_build(ckpt, tmp_path / "tp1", 1, quant=recipe).out_dir, device="cpu")
    two = Engine.load(_build(ckpt, tmp_path / "tp2", 2, quant=recipe).out_dir, device="cpu")
    kinds = {"fp8": "Fp8Linear", "int4": "Int4Linear"}
    spec = json.loads((two.path / "rank1" / "program.json").read_text())
    assert sum(n["op"] == kinds[quant] for n in spec["nodes"]) >= 8  # the decoder's linears stay quantized
    seed = 0 if quant == "fp8" else int(np.random.SeedSequence().entropy % 2**31)
    prompts = _prompts(seed)
    assert [o.token_ids for o in two.generate(prompts, PARAMS)] == [o.token_ids for o in
                                                                   one.generate(prompts, PARAMS)], seed
    for p in prompts:
        ref = _logits(one, p)
        bound = 1e-5 if quant == "int4" else 2e-2 * float(np.abs(ref).max())
        np.testing.assert_allclose(_logits(two, p), ref, rtol=0, atol=bound, err_msg=f"seed {seed}")
    two._session.close()


def test_a_hung_worker_fails_the_step_after_the_timeout(llama_engines, monkeypatch):
    """SIGSTOP a rank: its peers' collectives give up after LLMC_TP_TIMEOUT seconds and the step fails with
    TensorParallelError instead of hanging."""
    monkeypatch.setenv("LLMC_TP_TIMEOUT", "3")
    eng = Engine.load(llama_engines[2], device="cpu")
    eng.submit(list(range(5, 30)), SamplingParams(max_tokens=200, ignore_eos=True))
    eng.step()
    pid = eng._session.worker_pids[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="did not answer within 3 s"):
            for _ in range(200):
                eng.step()
        assert time.monotonic() - t0 < 15
    finally:
        with contextlib.suppress(ProcessLookupError):  # the engine has killed it already
            os.kill(pid, signal.SIGKILL)


def test_prefix_cache_hits_and_preemption_on_a_tp_engine(llama_engines):
    """A pool of 96 tokens and repeated prompts: prefix-cache hits and preemptions happen on rank 0's block
    tables, every rank's KV follows them, and the tokens stay tp=1's."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    p = list(range(5, 25))
    prompts = [p, p + [7], p, list(range(40, 60))]
    got = {}
    for tp in (1, 2):
        eng = Engine.load(llama_engines[tp], device="cpu", kv_cache_tokens=96)
        first = eng.generate([p], params)[0].token_ids
        got[tp] = (first, [o.token_ids for o in eng.generate(prompts, params)], eng.stats())
    assert got[2][:2] == got[1][:2]
    stats = got[2][2]
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
