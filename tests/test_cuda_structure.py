"""The structure of a CUDA engine's decode step, per recipe, checked with no GPU (issue 51 item 5).

One decode step of a tiny llama's CUDA program is counted as a GPU runs it (llmc.runtime.workers.cuda.launches: the
session on torch's meta device, the AOT kernels recording their launches, a dispatch mode recording every aten op
that launches a kernel): at most a stated number of kernel launches per decoder layer; quantized weights held
packed on the device (the device bytes are the weights file's, no dequantized copy held or written in the step);
no host synchronisation and no host copy inside the step, so the session captures it in a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.compiler.build import BuildOptions, build
from llmc.quant.recipe import QuantRecipe
from llmc.runtime.workers.cuda.launches import decode_structure
from llmc.runtime.workers.cuda.ops import OPS

# Launches per decoder layer of a decode step (batch 1, the tiny llama: packed QKV and gate/up projections).
# bf16: 2 RMSNorms (the first adds the residual), QKV, 2 rotaries (q, k), attention (2: the split-KV decode kernel,
#   which writes the new K/V too, and the reduce of its splits; one launch where the batch fills the GPU without
#   splitting, and one FlashAttention-style kernel for a prefill step), o_proj, gate/up, SwiGLU, down_proj.
# fp8: the same kernels, the norms and SwiGLU writing E4M3 codes, each linear one torch._scaled_mm, plus one
#   quantize kernel before o_proj (attention's output).
# int4 (groups of 32: K = 64 splits in two at batch 1): each linear the W4A16 kernel + the sum of its two float32
#   split-K partials + the cast to the engine dtype (3 launches); int4-awq: + AWQ's input scale (a Mul before
#   down_proj). Past 16 rows (decode batches, prefill chunks) the wide tiling runs, its split-K bounded by the
#   partials' bytes (none here): the same bound holds at every row count.
BOUNDS = {"bf16": 11, "fp8": 12, "int4": 19, "int4-awq": 20}
RECIPES = {"bf16": None,
           "fp8": QuantRecipe(quant="fp8", calib_samples=4, calib_seq_len=32),
           "int4": QuantRecipe(quant="int4", group_size=32),
           "int4-awq": QuantRecipe(quant="int4-awq", group_size=32, calib_samples=4, calib_seq_len=32)}
QUANTIZED = {"fp8": ("Fp8Linear", torch.float8_e4m3fn, "F8_E4M3"), "int4": ("Int4Linear", torch.uint8, "U8"),
             "int4-awq": ("Int4Linear", torch.uint8, "U8")}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("cuda-structure")
    built = {}
    for name, recipe in RECIPES.items():
        kw = {"quant": recipe} if recipe is not None else {}
        r = build(tiny_llama, out / name, BuildOptions(target="h100", **kw))
        built[name] = (r.out_dir, r.manifest)
    return built


def _file_tensors(path) -> dict[str, tuple[str, list[int]]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def _linear_shapes(root, op: str) -> dict[int, tuple[int, int]]:
    """Program node index -> (K, N) of each ``op`` node's weight."""
    spec = json.loads((root / "program.json").read_text())
    tensors = _file_tensors(root / "weights.safetensors")
    out = {}
    for i, n in enumerate(spec["nodes"]):
        if n["op"] == op:
            a, b = tensors[n["inputs"][1]][1]
            out[i] = (b, a) if op == "Fp8Linear" else (n["attrs"]["k"], b)  # E4M3 [N, K]; INT4 [K/2, N]
    assert out
    return out


def _dequantizes(s, root, op: str) -> bool:
    """Whether an ``op`` node writes a tensor larger than its rows (rows x max(K, N)): a dequantized weight (decode:
    fewer rows than the weight's K and N)."""
    return any(s.largest_writes.get(i, 0) > s.rows * max(k, n) for i, (k, n) in _linear_shapes(root, op).items())


# What an INT4 linear may launch: the W4A16 kernel over the packed codes, then (split-K) the float32 partials' sum and
# its cast to the engine dtype. Anything else is the torch op (unpack, sign, scales repeated: a dequantized weight).
_INT4_LAUNCHES = (["int4_matmul_kernel"], ["int4_matmul_kernel", "aten.sum", "aten.to"])


def _int4_launches(s) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for x in s.launches:
        if x.op == "Int4Linear":
            out.setdefault(x.node, []).append(x.kernel)
    return out


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_decode_step_launches_at_most_the_stated_kernels_per_layer(engines, recipe):
    root, manifest = engines[recipe]
    s = decode_structure(root, manifest, batch=1)
    assert s.layers == manifest["kv_cache"]["num_layers"] == 2
    assert max(s.per_layer) <= BOUNDS[recipe], (s.per_layer, s.kernels_by_op(1))
    assert len(set(s.per_layer)) == 1  # every layer the same
    assert s.kernels_by_op(1).get("PagedAttention") == 2  # split-KV decode + reduce (ATTENTION below)


# What a layer's attention launches (plugins/paged_attention/flash.py), by step: a decode step of a few sequences
# splits each context (decode + reduce), a batch that fills the GPU with its own programs does not (the split rule,
# flash_requests.decode_num_splits: 4 programs per SM = 528 on 132 SMs, the tiny llama has 2 KV heads), a prefill
# step is one launch of the FlashAttention-2-style kernel. Never a copy of the strided Q/K/V views, never torch.
ATTENTION = {(1, 1): ["split_kv_decode_kernel", "split_kv_reduce_kernel"],
             (64, 1): ["split_kv_decode_kernel", "split_kv_reduce_kernel"],
             (256, 1): ["split_kv_decode_kernel"],
             (1, 300): ["flash_prefill_kernel"], (4, 512): ["flash_prefill_kernel"]}


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize(("batch", "tokens"), sorted(ATTENTION))
def test_attention_launches_the_flash_kernels(engines, recipe, batch, tokens):
    root, manifest = engines[recipe]
    s = decode_structure(root, manifest, batch=batch, tokens=tokens)
    per_node: dict[int, list[str]] = {}
    for x in s.launches:
        if x.op == "PagedAttention":
            per_node.setdefault(x.node, []).append(x.kernel)
    assert len(per_node) == s.layers and all(k == ATTENTION[(batch, tokens)] for k in per_node.values()), per_node
    assert max(s.per_layer) <= BOUNDS[recipe] and s.host_syncs == [] and s.host_copies == []


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_decode_step_is_capture_safe_and_the_session_captures_it(engines, recipe):
    root, manifest = engines[recipe]
    for batch in (1, 16):
        s = decode_structure(root, manifest, batch=batch)
        assert s.host_syncs == [] and s.host_copies == []
        assert s.aot_kernels and s.capture_safe  # a GPU session replays decode from CUDA graphs


@pytest.mark.parametrize("recipe", sorted(QUANTIZED))
def test_quantized_weights_stay_packed_on_the_device(engines, recipe):
    root, manifest = engines[recipe]
    op, dtype, st = QUANTIZED[recipe]
    s = decode_structure(root, manifest, batch=1)
    # the device holds the weights file's tensors (less a few host-side shape constants), nothing more
    assert s.weights_file_bytes - 1024 <= s.device_weight_bytes <= s.weights_file_bytes
    packed = sum(torch.Size(shape).numel() for d, shape in _file_tensors(root / "weights.safetensors").values()
                 if d == st)
    assert s.weight_bytes_by_dtype[str(dtype).removeprefix("torch.")] == packed
    # and no kernel of a decode step writes a dequantized weight
    for batch in (1, 16, 32, 64):
        assert not _dequantizes(decode_structure(root, manifest, batch=batch), root, op)


@pytest.mark.parametrize("recipe", ["int4", "int4-awq"])
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (16, 1), (17, 1), (32, 1), (64, 1), (1, 300), (4, 512)])
def test_int4_linears_run_the_packed_code_kernel_at_every_row_count(engines, recipe, batch, tokens):
    """Decode at any batch and prefill chunks: every INT4 linear launches the W4A16 kernel over its packed codes (the
    decode tiling up to 16 rows, the wide one past them) and nothing that dequantizes its weight; the layer stays
    within the decode bound."""
    root, manifest = engines[recipe]
    s = decode_structure(root, manifest, batch=batch, tokens=tokens)
    launched = _int4_launches(s)
    assert set(launched) == set(_linear_shapes(root, "Int4Linear"))
    assert all(ks in _INT4_LAUNCHES for ks in launched.values()), launched
    assert max(s.per_layer) <= BOUNDS[recipe], (s.per_layer, s.kernels_by_op(1))
    assert s.host_syncs == [] and s.host_copies == []


def test_the_counter_sees_a_dequantized_weight_and_a_host_sync(engines, monkeypatch):
    """The checks above can fail: an INT4 linear without its W4A16 kernel (the wide tiling removed from the
    manifest, or both) runs the torch op, which dequantizes its weight (written in the step), and an op reading a
    device value on the host is caught."""
    root, manifest = engines["int4"]
    kernels = manifest["engine"]["kernels"]
    for dropped in ("+wide", ""):
        kept = [k for k in kernels if k.get("op") != "int4_matmul" or not k["key"].endswith(dropped)]
        assert len(kept) < len(kernels)
        slim = {**manifest, "engine": {**manifest["engine"], "kernels": kept}}
        for batch in (32, 1):
            s = decode_structure(root, slim, batch=batch)
            fell_back = dropped == "" or batch > 16
            assert _dequantizes(s, root, "Int4Linear") == fell_back
            assert all(ks in _INT4_LAUNCHES for ks in _int4_launches(s).values()) == (not fell_back)
            assert (max(s.per_layer) > BOUNDS["int4"]) == fell_back
    mul = OPS["Mul"]
    monkeypatch.setitem(OPS, "Mul", lambda a, b, **k: mul(a, b * float(b.reshape(-1)[0].item()), **k))
    synced = decode_structure(*engines["bf16"], batch=1)
    assert synced.host_syncs and not synced.capture_safe


def test_inspect_prints_the_kernels_per_layer(engines):
    root, _ = engines["fp8"]
    r = CliRunner().invoke(cli, ["inspect", str(root)])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("kernels "))
    assert f"2 layers × {BOUNDS['fp8']}" in line, line
    assert "Fp8Linear 5" in r.output and "captured in CUDA graphs" in r.output


# -- MXFP4 experts (a tiny gpt-oss in OpenAI's MXFP4 layout, tests/test_prequantized_mxfp4.py) ---------------------


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from tests.test_prequantized_mxfp4 import write_mxfp4_fixture

    out = tmp_path_factory.mktemp("cuda-structure-mxfp4")
    r = build(write_mxfp4_fixture(out), out / "engine", BuildOptions(target="h100"))
    return r.out_dir, r.manifest


def _moe_launches(s) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for x in s.launches:
        if x.op == "Mxfp4MoEMatMul":
            out.setdefault(x.node, []).append(x.kernel)
    return out


@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (32, 1), (1, 300)])
def test_mxfp4_experts_run_the_grouped_kernel_from_the_stored_codes(gpt_oss, batch, tokens):
    """Each MoE layer sorts its routed rows' expert ids once (torch.sort on the device) and each of its two expert
    matmuls is one launch of the grouped kernel over the stored codes: nothing writes a decoded expert (no tensor
    past the rows' own size), the experts stay uint8 on the device, and decode is captured in CUDA graphs."""
    root, manifest = gpt_oss
    s = decode_structure(root, manifest, batch=batch, tokens=tokens)
    moe = _moe_launches(s)
    spec = json.loads((root / "program.json").read_text())
    nodes = [i for i, n in enumerate(spec["nodes"]) if n["op"] == "Mxfp4MoEMatMul"]
    assert sorted(moe) == nodes and len(nodes) == 2 * s.layers
    for first, second in zip(nodes[0::2], nodes[1::2], strict=True):
        assert moe[first] == ["aten.sort", "mxfp4_moe_kernel"] and moe[second] == ["mxfp4_moe_kernel"], moe
    top_k = json.loads((root / "hf_config.json").read_text())["num_experts_per_tok"]
    assert all(s.largest_writes.get(i, 0) <= s.rows * top_k for i in nodes)  # the sort's ids and permutation
    tensors = _file_tensors(root / "weights.safetensors")
    experts = sum(torch.Size(shape).numel() for name, (d, shape) in tensors.items() if "experts" in name and d == "U8")
    assert experts and s.weight_bytes_by_dtype["uint8"] >= experts
    assert s.host_syncs == [] and s.host_copies == [] and s.capture_safe


def test_the_counter_sees_a_decoded_expert(gpt_oss):
    """The check above can fail: without the grouped kernel the torch op gathers and decodes each row's expert
    (a [rows, N, K] tensor written in the step)."""
    root, manifest = gpt_oss
    kept = [k for k in manifest["engine"]["kernels"] if k.get("op") != "mxfp4_moe"]
    slim = {**manifest, "engine": {**manifest["engine"], "kernels": kept}}
    s = decode_structure(root, slim, batch=1)
    spec = json.loads((root / "program.json").read_text())
    tensors = _file_tensors(root / "weights.safetensors")
    for i, n in enumerate(spec["nodes"]):
        if n["op"] == "Mxfp4MoEMatMul":
            e, n_out, groups, _ = tensors[n["inputs"][2]][1]
            assert s.largest_writes[i] >= n_out * groups * 32  # a routed row's whole expert, decoded
            assert "mxfp4_moe_kernel" not in _moe_launches(s)[i]
