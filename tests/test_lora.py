"""LoRA fine-tuning (--use_peft): only the adapters train, every layout reproduces one
process, the planner and the ZeRO table count the frozen base as frozen, and what is saved
loads with peft and with plain transformers.

The single-process reference (tests/reference.py) puts peft's adapters on the same model
with the same initial values (raylm.models.lora.adapter_value: a function of seed and name)
and trains them with torch's AdamW; the layouts are held to the tolerances of every other
parity test. The adapters sit on GPT-2's fused c_attn (column-parallel, its q/k/v rows
reordered per rank), on both c_proj layers (row-parallel) and on c_fc (column-parallel).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from raylm import TrainConfig, train
from raylm.models.lora import BASE_DIR, MERGED_DIR
from tests.conftest import TINY_GPT2
from tests.numerics import assert_steps_match, assert_weights_match
from tests.reference import reference_fixture

STEPS = 3
GLOBAL_BATCH = 8
MICRO = 2
TARGETS = ["c_attn", "c_proj", "c_fc"]


def lora_config(out, corpus, cache_root, model="gpt2", **kw) -> TrainConfig:
    dp = kw.get("dp", 1)
    base = dict(model_type=model, config_overrides=TINY_GPT2, train_file=[str(corpus)],
                block_size=32, data_cache_dir=cache_root, output_dir=str(out),
                max_steps=STEPS, logging_steps=1, save_steps=1000, disable_tqdm=True,
                learning_rate=1e-2, warmup_steps=1, per_device_train_batch_size=MICRO,
                cpus_per_worker=0.5, gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * dp),
                use_peft=True, lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                lora_target_modules=TARGETS)
    base.update(kw)
    return TrainConfig(**base)


reference = reference_fixture("lora", lora_config, GLOBAL_BATCH, STEPS)


def initial_base(out: str, seed: int = 42) -> dict:
    """The base model as raylm builds it from scratch (torch.manual_seed, then
    transformers' from_config), built here independently of the run."""
    config = AutoConfig.from_pretrained(os.path.join(out, BASE_DIR))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).state_dict()


def trained_model(out: str):
    """The run's output as a user loads it: the saved base, then the adapter on it."""
    base = AutoModelForCausalLM.from_pretrained(os.path.join(out, BASE_DIR))
    return PeftModel.from_pretrained(base, out)


# (dp, pp, tp, zero stage)
RUNS = [(1, 1, 2, 0), (1, 2, 1, 0), (2, 1, 1, 2), (2, 1, 1, 3)]


# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_lora_layout_matches_single_process": {"dp1-pp2-tp1", "dp2-pp1-tp1-zero3"},
}


@pytest.mark.parametrize("dp,pp,tp,stage", RUNS,
                         ids=[f"dp{d}-pp{p}-tp{t}" + (f"-zero{z}" if z else "")
                              for d, p, t, z in RUNS])
def test_lora_layout_matches_single_process(dp, pp, tp, stage, reference, ray_cluster,
                                            corpus_dir, cache_root, tmp_path):
    merge = tp > 1  # (the merged model and a resume are checked once)
    result = train(lora_config(tmp_path / "out", corpus_dir, cache_root, dp=dp, pp=pp, tp=tp,
                               num_workers=dp * pp * tp, zero_stage=stage, merge_lora=merge,
                               save_steps=1 if merge else 1000))
    out = result.output_dir
    ref = reference("gpt2")
    assert_steps_match(result.history, ref, STEPS, label=out)  # losses and gradient norms

    # The base is bit-identical to the model the run started from; the adapters trained.
    model = trained_model(out)
    state = {k.removeprefix("base_model.model."): v for k, v in model.state_dict().items()}
    start = initial_base(out)
    base = {k: v for k, v in state.items() if "lora_" not in k}
    assert {k.replace(".base_layer.", ".") for k in base} == set(start)
    for name, value in base.items():
        assert torch.equal(value, start[name.replace(".base_layer.", ".")]), name
    lora_b = [v for k, v in state.items() if "lora_B" in k]  # 4 layers x 2 blocks
    assert len(lora_b) == 4 * 2 and all(v.abs().max() > 0 for v in lora_b)
    # ... and they are the single process's adapters (base and adapters, as every
    # parity test holds weights).
    assert_weights_match(state, ref.state, ref.exact, ref.lr_sum, label=out,
                         allowance=ref.allowance)

    # Only the adapter is in output_dir; PeftModel loaded it above.
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    if merge:  # the merged model loads with plain transformers, the same logits
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, MERGED_DIR))
        assert not any("lora" in k for k in merged.state_dict())
        ids = torch.randint(0, merged.config.vocab_size, (2, 16),
                            generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, model(ids).logits,
                                       rtol=1e-5, atol=1e-5)
        # Its step-1 checkpoint (adapters sharded over tp, c_attn's lora_B rows
        # reordered) resumes under ZeRO-3 on dp=2 with the uninterrupted losses.
        resumed = train(lora_config(tmp_path / "z3", corpus_dir, cache_root, dp=2,
                                    num_workers=2, zero_stage=3, resume_from_checkpoint=
                                    os.path.join(out, "checkpoints", "step-00000001")))
        assert [h["step"] for h in resumed.history] == list(range(2, STEPS + 1))
        torch.testing.assert_close([h["loss"] for h in resumed.history], ref.losses[1:],
                                   rtol=1e-5, atol=0)
    else:
        assert not os.path.exists(os.path.join(out, MERGED_DIR))

    # Frozen parameters have no gradient and no optimizer state: measured so, and the
    # planner predicts what was measured.
    import json

    memory = json.load(open(os.path.join(out, "memory.json")))
    for r in memory["ranks"]:
        m, pred, trained = r["measured"], r["predicted"], r["replica_trained"]
        assert trained < r["replica_elements"] / 20
        assert r["zero_theory"]["gradients"] == 4 * trained / (dp if stage >= 2 else 1)
        for kind, per in (("gradients", 4), ("optimizer", 8)):
            assert m[kind] <= 1.1 * per * trained + 256, (kind, m, trained)
            assert abs(pred[kind] - m[kind]) <= 0.05 * m[kind] + 256, (kind, pred, m)


def test_zero_table_counts_no_gradients_or_optimizer_state_for_the_frozen_base(tmp_path):
    """raylm plan's ZeRO ownership table: parameters are every tensor's rows, gradients
    and optimizer states the adapters' only."""
    from raylm.models.loading import resolve_block_size, resolve_model
    from raylm.models.units import meta_model
    from raylm.plan.layout import make_plan
    from raylm.report.ownership import zero_ownership

    cfg = TrainConfig(model_type="gpt2", config_overrides=TINY_GPT2, block_size=32,
                      num_workers=2, dp=2, zero_stage=1, use_peft=True, lora_rank=4,
                      lora_target_modules=TARGETS, output_dir=str(tmp_path))
    spec = resolve_model(cfg)
    seq = resolve_block_size(cfg, spec)
    model = meta_model(spec)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trained < total / 20
    for e in zero_ownership(spec, make_plan(cfg, 2, spec, seq), seq):
        assert e["elements"]["parameters"] == total  # ZeRO-1 keeps every parameter
        assert e["elements"]["gradients"] == trained
        assert abs(e["elements"]["optimizer"] - trained / 2) <= 8 * 4  # a row per tensor
        assert e["bytes"]["optimizer"] == 8 * e["elements"]["optimizer"]
    assert math.isclose(sum(p.numel() for n, p in model.named_parameters()
                            if "lora_" in n), trained)
