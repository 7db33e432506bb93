"""scripts/train_default_model.py --plant-induction: the hand-set induction circuit copies, and training keeps it.

The speculative benchmark's copying target starts from this circuit (benchmarks/bench_speculative.py); these
tests hold the circuit to what its docstring claims, on fresh random token spans.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_default_model.py"


@pytest.fixture(scope="module")
def train_script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(ts, hidden: int, heads: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
                      tie_word_embeddings=False, rope_theta=ts.PLANT_ROPE_THETA, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).eval()


def _copy_accuracy(model: LlamaForCausalLM, length: int, gen: torch.Generator) -> float:
    """Greedy next-token accuracy on the second occurrence of a random 48-token span in random tokens."""
    hits = total = 0
    with torch.no_grad():
        for _ in range(4):
            x = torch.randint(4, 4096, (1, length + 1), generator=gen)
            a = int(torch.randint(0, length // 2 - 48, (1,), generator=gen))
            b = int(torch.randint(length // 2, length - 48, (1,), generator=gen))
            x[0, b: b + 48] = x[0, a: a + 48]
            pred = model(input_ids=x[:, :-1]).logits[0].argmax(-1)
            rows = torch.arange(b + 1, b + 47)  # the first copied token is unpredictable; row i predicts i + 1
            hits += int((pred[rows] == x[0, rows + 1]).sum())
            total += len(rows)
    return hits / total


@pytest.mark.parametrize("hidden,heads", [(256, 4), (384, 6)])
def test_planted_circuit_copies_random_spans_before_any_training(train_script, hidden, heads):
    model = _model(train_script, hidden, heads)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    before = _copy_accuracy(model, 256, gen)  # random weights: chance
    train_script.plant_induction(model, seed=0)
    assert before < 0.05
    assert _copy_accuracy(model, 256, gen) > 0.8


def test_training_keeps_the_circuit_and_moves_the_rest(train_script):
    model = _model(train_script, 256, 4).train()
    params = dict(model.named_parameters())
    frozen = {n: (m, params[n].detach().clone()) for n, m in train_script.plant_induction(model).items()}
    start = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        x = torch.randint(4, 4096, (2, 65))
        loss = torch.nn.functional.cross_entropy(model(input_ids=x[:, :-1]).logits.reshape(-1, 4096),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_script.restore_frozen(model, frozen)
    for name, (mask, values) in frozen.items():
        assert torch.equal(params[name][mask], values[mask]), name
    moved = [n for n, p in params.items() if not torch.equal(p, start[n])]
    assert "model.layers.1.mlp.down_proj.weight" in moved and "lm_head.weight" in moved


def test_shapes_the_circuit_cannot_fit_are_refused(train_script):
    assert train_script.induction_layout(128, 2, 64) is None  # four 31-dim codes: too narrow to tell tokens apart
    assert train_script.induction_layout(256, 4, 64) == (63, 2, 4)
    with pytest.raises(SystemExit):
        train_script.parse_args(["--plant-induction", "--layers", "8"])
