"""The architecture self-check every build runs (compiler/selfcheck.py): a random twin of the checkpoint's
config through the same pipeline, against transformers."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.compiler import selfcheck
from llmc.compiler.build import BuildOptions, build
from llmc.errors import UnsupportedError
from llmc.passes.base import GraphPass, replace_value


@pytest.fixture
def checked(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_SELF_CHECK", "1")
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def first_checked(tmp_path_factory, tiny_llama):
    """The tiny checkpoint's first build with the self-check on, through the CLI, into a cache of its own: the
    twin is built and held to transformers once for this file's two tests of it."""
    root = tmp_path_factory.mktemp("checked")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMC_SELF_CHECK", "1")
        mp.setenv("LLMC_CACHE_DIR", str(root / "cache"))
        result = CliRunner().invoke(cli, ["build", str(tiny_llama), "-o", str(root / "e"), "--json", "-q"])
    return root, result


def test_every_build_checks_its_architecture_once_then_from_the_cache(first_checked, checked, tmp_path, tiny_llama,
                                                                      monkeypatch):
    root, result = first_checked
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("LLMC_CACHE_DIR", str(root / "cache"))  # where the first build recorded its check
    first = json.loads((root / "e" / "report.json").read_text())
    assert first["self_check"]["result"] == "passed"
    info = json.loads((root / "e" / "build_info.json").read_text())["self_check"]
    assert info["status"] == "passed" and info["max_logprob_error"] < 1e-4 and info["max_logit_rel_error"] < 1e-4
    twin = first["self_check"]["twin_config"]
    assert twin["model_type"] == "llama" and twin["num_hidden_layers"] == 2
    again = build(tiny_llama, tmp_path / "b", BuildOptions(block_size=16))
    assert again.build_info["self_check"]["status"] == "cached"  # no twin built: the record answered
    # sealed files stay deterministic
    assert json.loads((tmp_path / "b" / "report.json").read_text())["self_check"] == first["self_check"]
    # another lowering (a CUDA engine) is another check
    cuda = build(tiny_llama, tmp_path / "c", BuildOptions(target="h100", dtype="float32", aot_kernels=False))
    assert cuda.build_info["self_check"]["status"] == "passed"


def _drop_biases(model: ir.Model) -> dict[str, int]:
    """Test-only: delete every Add of a bias initializer (a lowering that forgets biases)."""
    n = 0
    for node in list(model.graph):
        if node.op_type != "Add":
            continue
        consts = [v for v in node.inputs if v is not None and v.const_value is not None and "bias" in v.name]
        if consts:
            other = next(v for v in node.inputs if v is not consts[0])
            replace_value(node.outputs[0], other)
            model.graph.remove(node, safe=True)
            n += 1
    return {"matches": n}


def test_a_lowering_that_drops_a_bias_is_stopped_and_named(checked, tmp_path):
    from llmc.testing.checkpoints import write_tiny_llama

    ckpt = write_tiny_llama(tmp_path / "ckpt", attention_bias=True, seed=4)
    broken = GraphPass("test-only-drop-biases", _drop_biases, "forgets biases on purpose")
    with pytest.raises(UnsupportedError) as err:
        build(ckpt, tmp_path / "e", BuildOptions(extra_passes=(broken,)))
    msg = str(err.value)
    assert err.value.exit_code == 3 and "self-check failed" in msg and "'llama'" in msg, msg
    assert "first differs after pass 'test-only-drop-biases'" in msg, msg  # named, not just refused
    assert not (tmp_path / "e").exists()


def test_cli_build_records_the_check_in_the_report(first_checked):
    root, r = first_checked
    assert r.exit_code == 0, r.output
    report = json.loads((root / "e" / "report.json").read_text())
    assert report["self_check"]["result"] == "passed"


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "mixtral", "qwen3_moe", "gpt2", "phi3"])
def test_shrunk_twin_keeps_the_semantics_and_loses_the_size(model_type, family_checkpoint):
    config = json.loads((family_checkpoint(model_type) / "config.json").read_text())
    twin = selfcheck.shrink_config(config)
    assert twin["model_type"] == model_type
    for key in ("rope_parameters", "rope_scaling", "hidden_act", "tie_word_embeddings", "attention_bias",
                "num_experts_per_tok", "vocab_size"):
        assert twin.get(key) == config.get(key), key
    if isinstance(config.get("layer_types"), list):  # every layer type survives
        assert set(twin["layer_types"]) == set(config["layer_types"][: config["num_hidden_layers"]])
    heads = twin.get("num_attention_heads") or twin.get("n_head")
    kv = twin.get("num_key_value_heads") or heads
    assert heads % kv == 0


def test_shrunk_deepseek_twin_keeps_a_moe_layer_and_valid_grouped_routing():
    """DeepSeek-V3's own config (671B shape, from transformers' defaults): the twin still has a MoE layer after
    the dense ones, routing groups that divide the experts, and enough experts for its top-k."""
    from transformers import AutoConfig

    config = {k: v for k, v in AutoConfig.for_model("deepseek_v3").to_dict().items() if not k.startswith("_")}
    twin = selfcheck.shrink_config(config)
    assert twin["first_k_dense_replace"] < twin["num_hidden_layers"] <= config["num_hidden_layers"]
    assert twin["n_routed_experts"] % twin["n_group"] == 0 and twin["topk_group"] <= twin["n_group"]
    per_group = twin["n_routed_experts"] // twin["n_group"]
    assert twin["num_experts_per_tok"] == config["num_experts_per_tok"] <= per_group * twin["topk_group"]
    assert twin["kv_lora_rank"] < config["kv_lora_rank"] and twin["head_dim"] == twin["qk_rope_head_dim"]


@pytest.mark.parametrize("model_type, overrides", [
    ("cohere2_moe", {}),  # layer_types and mlp_layer_types: 40 entries each
    ("cohere2_moe", {"num_hidden_layers": 5, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "dense"]}),
    ("smollm3", {}),  # no_rope_layers: per-layer 0/1 flags, a NoPE layer every 4th
    ("qwen3_moe", {"num_hidden_layers": 6, "mlp_only_layers": [1, 5]}),  # layer indices, not per-layer entries
])
def test_shrunk_twin_cuts_every_per_layer_list_with_the_layer_count(model_type, overrides):
    """transformers' config classes refuse a per-layer list whose length is not the layer count, whatever the
    family calls it; the twin cuts each one, keeps a layer of each kind, and its config class accepts it."""
    from transformers import AutoConfig

    config = {k: v for k, v in AutoConfig.for_model(model_type, **overrides).to_dict().items()
              if not k.startswith("_")}
    layers = config["num_hidden_layers"]
    per_layer = [k for k, v in config.items() if isinstance(v, list) and len(v) == layers and k != "mlp_only_layers"]
    twin = selfcheck.shrink_config(config)
    n = twin["num_hidden_layers"]
    assert n < layers or model_type == "qwen3_moe"
    for key in per_layer:
        assert twin[key] == config[key][:n], key
        assert set(twin[key]) == set(config[key]), f"{key}: a kind of layer was lost"
    if "mlp_only_layers" in overrides:
        assert twin["mlp_only_layers"] == [i for i in overrides["mlp_only_layers"] if i < n]
    AutoConfig.for_model(**twin)  # raises if any per-layer list disagrees with the count
    cut = selfcheck.cut_layers(twin, "num_hidden_layers", 1)  # the diagnosis's one-layer cut
    AutoConfig.for_model(**cut)
    assert all(len(cut[k]) == 1 for k in per_layer)


def test_shrunk_hunyuan_twin_has_as_many_experts_as_its_moe_topk():
    """HunYuan names its top-k moe_topk: a twin with fewer experts than that cannot route a token."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("hunyuan_v1_moe", num_experts=64, moe_topk=8, head_dim=128).to_dict()
    twin = selfcheck.shrink_config({k: v for k, v in config.items() if not k.startswith("_")})
    assert twin["moe_topk"] == 8 <= twin["num_experts"] < 64


def test_scratch_of_a_dead_owner_is_removed_and_live_or_unmarked_scratch_stays(tmp_path):
    """A build or worker killed with SIGKILL leaves its scratch directory; the next self-check removes those whose
    owner process is gone, and nothing else."""
    import os
    import subprocess
    import sys

    from llmc.compiler.selfcheck import OWNER_FILE, SCRATCH_PREFIX, mark_scratch

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def scratch(name: str, owner: int | None):
        d = tmp_path / name
        (d / "twin").mkdir(parents=True)
        if owner is not None:
            (d / OWNER_FILE).write_text(str(owner))
        return d

    orphan = scratch(SCRATCH_PREFIX + "orphan", dead.pid)
    orphan_job = scratch(SCRATCH_PREFIX + "job-orphan", dead.pid)
    live = scratch(SCRATCH_PREFIX + "live", os.getppid())
    unmarked = scratch(SCRATCH_PREFIX + "unmarked", None)
    other = scratch("someone-else", dead.pid)
    new = tmp_path / (SCRATCH_PREFIX + "new")
    new.mkdir()
    mark_scratch(new)
    assert not orphan.exists() and not orphan_job.exists()
    assert live.exists() and unmarked.exists() and other.exists()
    assert (new / OWNER_FILE).read_text() == str(os.getpid())


def test_a_killed_builds_calibration_spill_is_removed_by_the_next_build(tmp_path, tiny_llama, monkeypatch):
    """The INT4 calibration spill (quant/stage.py: an 8B layer's weights waiting on disk) names its owner like the
    self-check's scratch: a build finds the spill of a dead build beside its own and removes it, leaves a live
    process's, and removes its own when done. The build runs through the CLI's entry in this process, its
    temporary directory moved as TMPDIR would move a process's (a process of its own would add a start of torch,
    transformers and torch.export); the live owner is another process, this one's parent."""
    import os
    import subprocess
    import sys
    import tempfile

    from llmc.quant.stage import SPILL_PREFIX
    from llmc.scratch import OWNER_FILE

    tmp = tmp_path / "tmp"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    spills = {}
    for name, owner in (("orphan", dead.pid), ("live", os.getppid())):
        d = tmp / (SPILL_PREFIX + name)
        d.mkdir(parents=True)
        (d / "layer_0.npz").write_bytes(b"x" * 1024)
        (d / OWNER_FILE).write_text(str(owner))
        spills[name] = d
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # tempfile read TMPDIR once, when this process first asked
    r = CliRunner().invoke(cli, ["build", str(tiny_llama), "-o", str(tmp_path / "e"), "--cache-dir",
                                 str(tmp_path / "cache"), "--quant", "int4-awq", "--calib-samples", "4",
                                 "--calib-seq-len", "32", "-q"])
    assert r.exit_code == 0, r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert not spills["orphan"].exists() and spills["live"].exists()
    assert sorted(d.name for d in tmp.glob(SPILL_PREFIX + "*")) == [SPILL_PREFIX + "live"]
