"""The generic torch.export pipeline split (raylm.models.export_split), in one process.

GPT-NeoX is the model under test because raylm has no hand-written layer list for it, so
it is exactly what the generic path is for; with tie_word_embeddings=True it also ties its
embedding to its lm head. Models are tiny and built from a seed, so two builds are equal.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from raylm.errors import ConfigError
from raylm.models.export_split import export_stage_modules
from raylm.models.units import layer_units

VOCAB, SEQ, LAYERS = 128, 16, 4
BOUNDS = {2: [(0, 2), (2, 4)], 4: [(0, 1), (1, 2), (2, 3), (3, 4)]}


def tiny_neox(tie: bool = False, dropout: float = 0.0) -> GPTNeoXForCausalLM:
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                           num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=64, use_cache=False,
                           hidden_dropout=dropout, attention_dropout=dropout,
                           tie_word_embeddings=tie)
    model = GPTNeoXForCausalLM(config)
    model.train()
    return model


def batch(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def run_chain(stages, input_ids):
    """Feed each stage exactly what the previous one returned, checking the contract."""
    out = stages[0](input_ids)
    for stage in stages[1:]:
        values = out if isinstance(out, tuple) else (out,)
        assert values and all(isinstance(v, torch.Tensor) for v in values)
        out = stage(*values)
    assert isinstance(out, torch.Tensor)
    return out


def lm_loss(logits, input_ids):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                       input_ids[:, 1:].reshape(-1))


def test_layer_units_finds_the_blocks():
    assert layer_units(tiny_neox()) == [f"gpt_neox.layers.{i}" for i in range(LAYERS)]


def test_layer_units_picks_the_largest_list_of_identical_blocks():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(2, 2) for _ in range(6))
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8),
                                                      nn.ModuleList([nn.Linear(8, 8)] * 9))
                                        for _ in range(3))

    # blocks hold the most parameters; the 9-long lists inside a block are not candidates
    assert layer_units(Model()) == ["blocks.0", "blocks.1", "blocks.2"]


def test_layer_units_without_a_list_takes_runs_of_one_type():
    # Swin's shape: stages of blocks that widen, with a merging layer between them
    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

    model = nn.Sequential(nn.Sequential(nn.Conv2d(1, 4, 1), nn.ReLU()),
                          nn.Sequential(Block(4), Block(4)), nn.Linear(4, 8),
                          nn.Sequential(Block(8), Block(8), Block(8)), nn.Linear(8, 2))
    assert layer_units(model) == ["1.0", "1.1", "3.0", "3.1", "3.2"]
    # a heavier module alone in its container is no run of blocks
    model.append(nn.Sequential(nn.Linear(8, 1000)))
    assert layer_units(model) == ["1.0", "1.1", "3.0", "3.1", "3.2"]


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)),
    nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(2, 2), nn.Conv1d(2, 3, 1)])}),
], ids=["no-module-list", "different-children"])
def test_layer_units_without_repeated_blocks_is_a_config_error(model):
    with pytest.raises(ConfigError, match="no repeated blocks"):
        layer_units(model)


@pytest.mark.parametrize("bounds", [[(0, 2), (3, 4)], [(0, 2), (2, 2), (2, 4)], [(0, 3)],
                                    [(1, 4)]])
def test_bad_bounds_are_a_config_error(bounds):
    with pytest.raises(ConfigError, match="bounds"):
        export_stage_modules(tiny_neox(), batch(2), bounds)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_stages_match_the_model(n_stages, tie):
    model, reference = tiny_neox(tie), tiny_neox(tie)
    assert (model.lm_head.weight is model.gpt_neox.embed_in.weight) == tie
    bounds = BOUNDS[n_stages]
    stages = export_stage_modules(model, batch(2), bounds)
    assert len(stages) == n_stages

    # Parameters: the model's own names and objects, every one held, each non-tied
    # parameter by exactly one stage (the one running its block), the tied one by the
    # first and the last stage.
    canonical = {id(p): name for name, p in model.named_parameters()}
    held = Counter()
    for s, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            assert canonical[id(param)] == name
            assert param is model.get_parameter(name)
            held[name] += 1
            if name.startswith("gpt_neox.layers."):
                block = int(name.split(".")[2])
                assert bounds[s][0] <= block < bounds[s][1]
    assert set(held) == set(canonical.values())
    shared = {name for name, count in held.items() if count > 1}
    if tie:
        assert shared == {"gpt_neox.embed_in.weight"}
        for stage in (stages[0], stages[-1]):
            assert stage.get_parameter("gpt_neox.embed_in.weight") is model.lm_head.weight
    else:
        assert shared == set()

    # Forward: a batch size other than the example's, same logits as the model.
    input_ids = batch(3, seed=2)
    logits = run_chain(stages, input_ids)
    assert logits.shape == (3, SEQ, VOCAB)
    torch.testing.assert_close(logits, model(input_ids=input_ids).logits, rtol=1e-6, atol=1e-6)

    # Backward: the same loss gives the same gradients as the plain model, per FQN; a tied
    # weight's gradient is the sum of its two uses, as in the model.
    lm_loss(logits, input_ids).backward()
    lm_loss(reference(input_ids=input_ids).logits, input_ids).backward()
    params = dict(model.named_parameters())
    for name, ref_param in reference.named_parameters():
        assert params[name].grad is not None, name
        torch.testing.assert_close(params[name].grad, ref_param.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_dropout_follows_the_model_and_the_seed():
    model, reference = tiny_neox(dropout=0.3), tiny_neox(dropout=0.3)
    # a one-row example still gives stages that take any batch size
    stages = export_stage_modules(model, batch(1), BOUNDS[2])
    input_ids = batch(5, seed=3)
    torch.manual_seed(7)
    first = run_chain(stages, input_ids)
    torch.manual_seed(7)
    torch.testing.assert_close(first, reference(input_ids=input_ids).logits, rtol=0, atol=0)
    torch.manual_seed(8)
    assert not torch.allclose(first, run_chain(stages, input_ids))


def test_parameters_the_forward_never_reads_are_kept():
    model = tiny_neox()
    for layer in model.gpt_neox.layers:
        layer.register_parameter("unused", nn.Parameter(torch.zeros(3)))
    model.register_parameter("unused_head", nn.Parameter(torch.zeros(3)))
    stages = export_stage_modules(model, batch(2), BOUNDS[2])
    assert stages[0].get_parameter("gpt_neox.layers.1.unused") is model.gpt_neox.layers[1].unused
    assert stages[1].get_parameter("gpt_neox.layers.2.unused") is model.gpt_neox.layers[2].unused
    assert stages[0].get_parameter("unused_head") is model.unused_head
    held = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(held) == sorted(name for name, _ in model.named_parameters())
