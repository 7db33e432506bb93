"""`llmc plan`: per-GPU weight bytes and KV capacity for the published shapes of Llama-3.1-70B, Qwen3-235B-A22B,
gpt-oss-120b and DeepSeek-V3 at tp 1/2/4/8 on h100/h200/b200, each held to a calculation written out here by
hand (not a call into llmc.compiler.deploy_plan); the CLI's table and --json through a real subprocess; every
error case with its exit code. No builds, no weights: config.json only."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.compiler.deploy_plan import report

GIB = 2**30
# Published device memory (GiB, as llmc's target table holds it) and HBM bandwidth (GB/s) of the SXM parts.
GPUS = {"h100": (80, 3350), "h200": (141, 4800), "b200": (180, 8000)}
TPS = (1, 2, 4, 8)

# config.json as published (fields the plan reads, plus the usual others).
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 8192,
    "intermediate_size": 28672, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 94, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 94, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936}
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280}


# -- the independent calculation ----------------------------------------------------------------------------------
# Storage per llmc's CUDA engine: floats bf16 (2 B); fp8 linear [n, k]: n*k codes + n float32 channel scales + one
# float32 activation scale; int4 linear: n*k/2 code bytes + per group of 128 inputs a bf16 scale and a uint8 zero
# point. Embeddings, routers, experts, norms and biases stay bf16 under every recipe; attention sinks float32.
# Sharded as llmc build --tp N shards (compiler/sharding.py): heads, MLP columns/rows and experts / N, KV heads split
# or one per GPU, embeddings and LM head vocab-parallel (each vocabulary here divides by 8), the rest on every GPU.

def linear(n, k, quant):
    if quant == "fp8":
        return n * k + 4 * n + 4
    if quant == "int4":
        return n * k // 2 + n * math.ceil(k / 128) * 3
    return 2 * n * k


def llama_weights(tp, quant):
    h, L, q, kv, d, ffn, vocab = 8192, 80, 64, 8, 128, 28672, 128256
    per_layer = (linear(q * d // tp, h, quant) + 2 * linear(kv * d // tp, h, quant) + linear(h, q * d // tp, quant)
                 + linear(2 * ffn // tp, h, quant)
                 + linear(h, ffn // tp, quant) + 2 * 2 * h)
    table = vocab // tp * h
    return L * per_layer + 2 * h + 2 * table + linear(vocab // tp, h, quant)


def qwen3_weights(tp, quant):
    h, L, q, kv, d, experts, ffn, vocab = 4096, 94, 64, 4, 128, 128, 1536, 151936
    kv_rank = kv // tp if tp <= kv else 1  # KV heads replicated beyond 4 GPUs
    attn = (linear(q * d // tp, h, quant) + 2 * linear(kv_rank * d, h, quant) + linear(h, q * d // tp, quant)
            + 2 * 2 * d)  # q_norm, k_norm
    moe = 2 * experts * h + 2 * (experts // tp) * (2 * ffn * h + h * ffn)  # router + experts, bf16
    per_layer = attn + moe + 2 * 2 * h
    return L * per_layer + 2 * h + 2 * vocab // tp * h + linear(vocab // tp, h, quant)


def gpt_oss_weights(tp, quant):
    h, L, q, kv, d, experts, ffn, vocab = 2880, 36, 64, 8, 64, 128, 2880, 201088
    attn = (linear(q * d // tp, h, quant) + 2 * linear(kv * d // tp, h, quant) + linear(h, q * d // tp, quant)
            + 2 * (q * d // tp + 2 * kv * d // tp + h)  # q, k, v, o biases
            + 4 * q // tp)  # sinks, float32 (what the attention kernels read)
    router = 2 * (experts * h + experts)
    expert = 2 * (2 * ffn * h + 2 * ffn + h * ffn + h)  # gate_up, its bias, down, its bias
    per_layer = attn + router + (experts // tp) * expert + 2 * 2 * h
    return L * per_layer + 2 * h + 2 * vocab // tp * h + linear(vocab // tp, h, quant)


def deepseek_weights(tp, quant):
    h, L, dense, heads, nope, rope, v, q_lora, kv_lora = 7168, 61, 3, 128, 128, 64, 128, 1536, 512
    experts, moe_ffn, ffn, vocab = 256, 2048, 18432, 129280
    hr = heads // tp
    attn = (linear(q_lora, h, quant) + 2 * q_lora + linear(hr * (nope + rope), q_lora, quant)
            + linear(kv_lora + rope, h, quant) + 2 * kv_lora + linear(hr * (nope + v), kv_lora, quant)
            + linear(h, hr * v, quant))
    dense_mlp = linear(2 * ffn // tp, h, quant) + linear(h, ffn // tp, quant)
    moe = (2 * (experts * h + experts) + 2 * (experts // tp) * 3 * moe_ffn * h
           + linear(2 * moe_ffn // tp, h, quant) + linear(h, moe_ffn // tp, quant))  # shared expert
    norms = 2 * 2 * h
    return (L * (attn + norms) + dense * dense_mlp + (L - dense) * moe + 2 * h
            + 2 * vocab // tp * h + linear(vocab // tp, h, quant))


def kv_per_token(name, tp, kv_bytes):
    if name == "llama":
        return 80 * 2 * (8 // tp) * 128 * kv_bytes
    if name == "qwen3":
        return 94 * 2 * max(1, 4 // tp) * 128 * kv_bytes
    if name == "gpt_oss":  # sliding layers keep every token too
        return 36 * 2 * (8 // tp) * 64 * kv_bytes
    return 61 * 2 * (128 // tp) * 192 * kv_bytes  # MLA as llmc stores it: 128 heads x 192, V padded to 192


MODELS = {"llama": (LLAMA_70B, llama_weights), "qwen3": (QWEN3_235B, qwen3_weights),
          "gpt_oss": (GPT_OSS_120B, gpt_oss_weights), "deepseek": (DEEPSEEK_V3, deepseek_weights)}


def expected(name, gpu, tp, quant, kv_bytes, max_len):
    config, weights_of = MODELS[name]
    mem_gib, _ = GPUS[gpu]
    w = weights_of(tp, quant)
    reserve = GIB + 2048 * config["vocab_size"] * 8
    room = int(0.9 * mem_gib * GIB) - w - reserve
    kv = kv_per_token(name, tp, kv_bytes)
    blocks = max(0, room // (kv * 16))
    return w, kv, blocks * 16, blocks // math.ceil(max_len / 16)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    out = {}
    for name, (config, _) in MODELS.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        out[name] = d
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("quant,kv_dtype", [("none", None), ("fp8", "fp8"), ("int4", None)])
def test_memory_and_kv_capacity_match_the_hand_calculation(configs, name, quant, kv_dtype):
    kv_bytes = 1 if kv_dtype == "fp8" else 2
    for gpu in GPUS:
        rep = report(configs[name], gpu, "1,2,4,8", quant, kv_dtype)
        assert rep["max_model_len"] == 32768  # every one of these configs allows more: capped
        rows = {p["tp"]: p for p in rep["plans"]}
        assert sorted(rows) == list(TPS)
        for tp in TPS:
            p = rows[tp]
            w, kv, tokens, batch = expected(name, gpu, tp, quant, kv_bytes, 32768)
            assert p["weights_bytes"] == w, (gpu, tp)
            assert p["kv_bytes_per_token"] == kv, (gpu, tp)
            assert p["kv_tokens"] == tokens, (gpu, tp)
            assert p["max_batch"] == batch, (gpu, tp)


def test_totals_are_the_published_parameter_counts(configs):
    # bf16 at tp 1 is 2 bytes per parameter: 70.6B, 235B, 117B (gpt-oss-120b), 671B (DeepSeek-V3 without MTP)
    for name, billions in (("llama", 70.6), ("qwen3", 235.1), ("gpt_oss", 116.8), ("deepseek", 671.0)):
        rep = report(configs[name], "h100", "1")
        assert rep["model"]["parameters"] == pytest.approx(billions * 1e9, rel=2e-3), name
        sinks = 2 * 36 * 64 if name == "gpt_oss" else 0  # float32: 2 B more than bf16 per head and layer
        assert rep["plans"][0]["weights_bytes"] == 2 * rep["model"]["parameters"] + sinks


def test_llama_fp8_h100_roofline_and_allreduce(configs):
    rep = report(configs["llama"], "h100", "1,2,4,8", "fp8", max_model_len=8192)
    rows = {p["tp"]: p for p in rep["plans"]}
    w8 = llama_weights(8, "fp8")
    # tp 8, batch 1: every weight read once except the embedding table (one row), plus 8192 tokens of KV
    base = w8 - 128256 // 8 * 8192 * 2
    per_sequence = 8192 * 2 + 8192 * kv_per_token("llama", 8, 2)  # its embedding row, its 8192 tokens of KV
    read = base + per_sequence
    assert rows[8]["decode_b1_bytes"] == read
    assert rows[8]["decode_b1_s"] == pytest.approx(read / 3350e9)
    assert rows[1]["allreduce_bytes_per_token"] == 0
    # per layer 2, and one after the vocab-parallel embedding lookup; the logits all-gathered (bf16)
    assert rows[8]["allreduce_bytes_per_token"] == (2 * 80 + 1) * 8192 * 2
    assert rows[8]["allreduce_ring_bytes_per_gpu"] == 2 * 7 * ((2 * 80 + 1) * 8192 * 2) // 8
    assert rows[8]["allgather_bytes_per_token"] == 128256 * 2
    b = rows[8]["max_batch"]
    assert b > 1 and rows[8]["decode_bmax_bytes"] == base + b * per_sequence
    assert rows[8]["decode_bmax_s"] == pytest.approx((base + b * per_sequence) / 3350e9)


def test_notes_say_what_llmc_stores(configs):
    ds = report(configs["deepseek"], "b200", "8", "fp8")
    assert any("MLA" in n and "padded from 128 to 192" in n for n in ds["notes"])
    assert any("multi-token-prediction" in n for n in ds["notes"])
    oss = report(configs["gpt_oss"], "h200", "4", "int4")
    assert any("MXFP4" in n for n in oss["notes"])
    assert any("does not split model_type 'gpt_oss' yet" in n for n in oss["notes"])
    assert not any("does not split" in n for n in ds["notes"])  # deepseek_v3 splits (MLA by heads)
    assert any("experts' batched weights stay bfloat16" in n for n in oss["notes"])
    p = oss["plans"][0]
    assert p["weights_bytes_if_experts_quantized"] < p["weights_bytes"]


def test_kv_heads_split_and_replicated(configs):
    # Qwen3-235B has 4 KV heads: split at tp 2 and 4, one replica per GPU at tp 8
    rows = {p["tp"]: p for p in report(configs["qwen3"], "h100", "2,4,8")["plans"]}
    assert rows[2]["kv_bytes_per_token"] == 94 * 2 * 2 * 128 * 2
    assert rows[4]["kv_bytes_per_token"] == rows[8]["kv_bytes_per_token"] == 94 * 2 * 1 * 128 * 2


def test_gemma4_per_layer_geometry_and_shared_kv(tmp_path):
    # A Gemma 4-style text config: 5 sliding layers of 256-wide heads then a full layer of 512-wide heads, the
    # last 2 layers reading earlier caches.
    types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    cfg = {"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 12,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
        "vocab_size": 262144, "sliding_window": 512, "layer_types": types, "num_kv_shared_layers": 2,
        "max_position_embeddings": 131072}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = report(tmp_path, "h100", "1")["plans"][0]
    # layers 10 (sliding) and 11 (full) read the last unshared layer of their type (9 and 5) and store nothing:
    # stored are 9 sliding layers x 1 KV head x 256 and 1 full layer x 1 KV head x 512
    assert p["kv_bytes_per_token"] == 2 * 1 * (9 * 256 + 512) * 2


def _run(*args):
    return subprocess.run([sys.executable, "-m", "llmc.cli.main", "plan", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_cli_table_and_json(configs):
    proc = _run(configs["llama"], "--gpu", "h100", "--tp", "1,2,4,8", "--quant", "fp8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "64 heads / 8 kv heads" in lines[0]
    rows = [ln for ln in lines if ln.startswith("h100")]
    assert [r.split()[1] for r in rows] == ["1", "2", "4", "8"]
    proc = _run(configs["llama"], "--gpu", "h100", "--tp", "1,2,4,8", "--quant", "fp8", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    for p in rep["plans"]:
        w, kv, tokens, batch = expected("llama", "h100", p["tp"], "fp8", 2, 32768)
        assert (p["weights_bytes"], p["kv_bytes_per_token"], p["kv_tokens"], p["max_batch"]) == (w, kv, tokens, batch)
    # the table prints the same tokens the JSON holds
    for row, p in zip(rows, rep["plans"], strict=True):
        assert f" {p['kv_tokens']:,} " in row


def test_cli_all_gpus_refuses_per_row(configs):
    proc = _run(configs["gpt_oss"], "--gpu", "all", "--quant", "fp8", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {p["gpu"]: p for p in json.loads(proc.stdout)["plans"]}
    assert not rows["a100"]["ok"] and "sm_89" in rows["a100"]["reason"]
    assert rows["b200"]["ok"] and rows["rtx5090"]["ok"]


@pytest.mark.parametrize("args,code,needle", [
    (["{missing}", "--gpu", "h100"], 2, "no such file"),
    (["{dir}", "--gpu", "h100"], 2, "holds no config.json"),
    (["{badjson}", "--gpu", "h100"], 2, "not valid JSON"),
    (["{nofield}", "--gpu", "h100"], 2, "'hidden_size'"),
    (["{nohead}", "--gpu", "h100"], 2, "hidden_size 8192 is not a multiple of num_attention_heads 48"),
    (["{llama}", "--gpu", "h900"], 2, "--gpu 'h900'"),
    (["{llama}", "--gpu", "cpu"], 2, "--gpu 'cpu'"),
    (["{llama}", "--gpu", "h100", "--tp", "0"], 2, "--tp"),
    (["{llama}", "--gpu", "h100", "--tp", "two"], 2, "--tp"),
    (["{llama}", "--gpu", "h100", "--tp", "3"], 2, "num_attention_heads 64 is not a multiple of 3"),
    (["{llama}", "--gpu", "h100", "--tp", "128"], 2, "num_attention_heads 64 is not a multiple of 128"),
    (["{moe6}", "--gpu", "h100", "--tp", "4"], 2, "the 6 experts per layer do not partition evenly over 4"),
    (["{kv6}", "--gpu", "h100", "--tp", "4"], 2, "num_key_value_heads 6"),
    (["{llama}", "--gpu", "h100", "--quant", "fp4"], 2, "--quant 'fp4'"),
    (["{llama}", "--gpu", "h100", "--kv-cache-dtype", "int8"], 2, "--kv-cache-dtype"),
    (["{llama}", "--gpu", "h100", "--gpu-memory-utilization", "1.5"], 2, "--gpu-memory-utilization"),
    (["{llama}", "--gpu", "h100", "--max-model-len", "0"], 2, "--max-model-len"),
    (["{llama}", "--gpu", "a100", "--quant", "fp8"], 3, "sm_89"),
    (["{llama}", "--gpu", "h100", "--quant", "nvfp4"], 3, "nvfp4"),
])
def test_errors_are_one_line_with_their_exit_code(configs, tmp_path, args, code, needle):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "nofield.json").write_text(json.dumps({k: v for k, v in LLAMA_70B.items() if k != "hidden_size"}))
    (tmp_path / "kv6.json").write_text(json.dumps({**LLAMA_70B, "num_attention_heads": 48,
                                                   "num_key_value_heads": 6, "head_dim": 128}))
    (tmp_path / "nohead.json").write_text(json.dumps({**LLAMA_70B, "num_attention_heads": 48}))
    (tmp_path / "moe6.json").write_text(json.dumps({**QWEN3_235B, "num_experts": 6}))
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "nope", "dir": tmp_path / "empty", "badjson": tmp_path / "bad.json",
             "nofield": tmp_path / "nofield.json", "kv6": tmp_path / "kv6.json",
             "moe6": tmp_path / "moe6.json", "nohead": tmp_path / "nohead.json", **configs}
    result = CliRunner().invoke(cli, ["plan", *[a.format(**paths) for a in args]])
    assert result.exit_code == code, result.output
    err = result.output.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], result.output


# Families whose tiny configs (llmc.testing.tried_families and alike) the plan must count exactly as transformers
# builds them: parameters (a tied table once) plus DeepSeek-style e_score_correction_bias buffers, which
# checkpoints carry.
COUNTED = {
    "llama": {}, "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "gemma3_text": {"head_dim": 16, "sliding_window": 16}, "gpt_oss": None, "deepseek_v3": None, "qwen2_moe": None,
}


def test_parameter_counts_match_transformers_models():
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler.deploy_plan import model_from_config
    from llmc.testing.tried_families import BASE, TRIED_FAMILIES

    for model_type, over in COUNTED.items():
        kwargs = TRIED_FAMILIES[model_type][0] if over is None else {**BASE, **over}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.for_model(model_type, **kwargs)
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(cfg)
        count = sum(p.numel() for p in hf.parameters())
        count += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
        planned = model_from_config(json.loads(cfg.to_json_string()), model_type)
        assert planned.parameters == count, model_type


def test_kv_layers_are_the_ones_llmcs_frontend_records():
    """The manifests' kv_cache.layers that tests/test_gemma4.py holds llmc's builds to, from the configs alone."""
    from llmc.compiler.deploy_plan import model_from_config
    from llmc.testing.tried_families import TRIED_FAMILIES

    e2b = model_from_config({"model_type": "gemma4_text", **TRIED_FAMILIES["gemma4_text"][0]}, "gemma4_text")
    assert [e.owner for e in e2b.kv_layers] == [0, 1, 2, 1, 1, 2]  # manifest: [3:] shares 1, 1, 2
    assert [(e.num_kv_heads, e.head_size) for e in e2b.kv_layers[:3]] == [(2, 16), (2, 16), (2, 32)]
    moe = {"model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2,
           "attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 32,
           "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
    assert [(e.num_kv_heads, e.head_size) for e in model_from_config(moe, "gemma4").kv_layers] == [(2, 16), (1, 32)] * 2


def test_a_vocabulary_that_does_not_divide_stays_whole(tmp_path):
    # 32001 rows do not split over 2 GPUs: llmc build --tp 2 keeps the embedding and the LM head whole on each
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32001, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rows = {p["tp"]: p for p in report(tmp_path, "h100", "1,2")["plans"]}
    for cls in ("embeddings", "lm_head"):
        assert rows[2]["weights_by_class"][cls] == rows[1]["weights_by_class"][cls] == 2 * 32001 * 256
    cfg["vocab_size"] = 32000
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rows = {p["tp"]: p for p in report(tmp_path, "h100", "1,2")["plans"]}
    assert rows[2]["weights_by_class"]["embeddings"] == 32000 // 2 * 256 * 2
