"""Dropout on, every layout computes one worker's function: per-step losses and gradient
norms of a tiny GPT-2 (embedding, residual and attention dropout 0.1; LoRA's dropout)
equal a one-worker run's within 1e-5, the masks drawn per sample and keyed by what they
mask (raylm.models.dropout): pipeline stages, tensor-parallel shards (with and without
sequence parallelism or a pipeline), ZeRO-3, recomputed blocks, compiled blocks."""

from __future__ import annotations

import numpy as np
import pytest

from raylm import TrainConfig, train

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)

STEPS = 3
# 4 blocks, so that pp=2 also runs two stages per rank (interleaved); dropout at
# GPT2Config's defaults (0.1).
GPT2 = "n_layer=4,n_embd=32,n_head=2,n_positions=64"
# GPT-NeoX: cut by the generic torch.export split (its graphs' dropouts keyed by module)
NEOX = dict(model_type="gpt_neox", config_overrides=(
    "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64,"
    "max_position_embeddings=64,attention_dropout=0.1,hidden_dropout=0.1"))
LORA = dict(use_peft=True, lora_rank=4, lora_alpha=8, lora_dropout=0.1,
            lora_target_modules=["c_attn", "c_proj", "c_fc"])


def config(out, corpus, cache_root, **kw) -> TrainConfig:
    base = dict(model_type="gpt2", config_overrides=GPT2, train_file=[str(corpus)],
                block_size=32, data_cache_dir=cache_root, output_dir=str(out),
                max_steps=STEPS, logging_steps=1, save_steps=1000, disable_tqdm=True,
                learning_rate=1e-3, warmup_steps=1, per_device_train_batch_size=2,
                gradient_accumulation_steps=4, cpus_per_worker=0.5, do_eval=False)
    base.update(kw)
    return TrainConfig(**base)


def assert_same_function(history, ref) -> None:
    assert [h["step"] for h in history] == [h["step"] for h in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in ref],
                                   rtol=1e-5, err_msg=key)


# (the global batch is per-device rows x accumulation x data-parallel ranks: dp=2 layouts
# accumulate half as many micro-batches, to take one worker's 8 rows a step; fewest ranks
# first, see one_worker)
LAYOUTS = {
    "tp2": dict(tp=2, num_workers=2),
    "tp2-sequence-parallel": dict(tp=2, num_workers=2, sequence_parallel=True),
    "dp2-zero3-recomputed": dict(num_workers=2, zero_stage=3, gradient_accumulation_steps=2,
                                 activation_checkpointing="full"),
    # (each block's forward compiled, its graph broken at each dropout; aot_eager: the
    # masks are drawn between graphs, which inductor's kernels never see)
    "tp2-compiled": dict(tp=2, num_workers=2, torch_compile=True,
                         torch_compile_backend="aot_eager"),
    "lora-tp2": dict(tp=2, num_workers=2, **LORA),
    "lora-pp2": dict(pp=2, num_workers=2, **LORA),
    "neox-pp2-exported": dict(pp=2, num_workers=2, **NEOX),
    # (pp=3: a middle stage, which reads its micro-batches for their ids alone)
    "pp3-1f1b-recomputed": dict(pp=3, num_workers=3, pipeline_schedule="1f1b",
                                activation_checkpointing="full"),
    "dp2xpp2-interleaved": dict(pp=2, num_workers=4, pipeline_schedule="interleaved_1f1b",
                                gradient_accumulation_steps=2),
    "dp2xpp2xtp2": dict(pp=2, tp=2, num_workers=8, gradient_accumulation_steps=2),
}
MODEL_KEYS = ("use_peft", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules",
              "model_type", "config_overrides")


@pytest.fixture(scope="module")
def one_worker(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    """One worker's per-step records of each model the layouts train (GPT-2, with or
    without LoRA; GPT-NeoX), computed first: then the layouts, fewest ranks first, each
    start only the rank processes the last run lacked (raylm.keep_ranks)."""
    runs = {}
    for kw in LAYOUTS.values():
        model = {k: v for k, v in kw.items() if k in MODEL_KEYS}
        key = repr(sorted(model.items()))
        if key not in runs:
            out = tmp_path_factory.mktemp("one") / "out"
            runs[key] = train(config(out, corpus_dir, cache_root, num_workers=1,
                                     **model)).history
    return lambda model: runs[repr(sorted(model.items()))]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_with_dropout_on_computes_one_workers_function(
        layout, one_worker, ray_cluster, corpus_dir, cache_root, tmp_path):
    kw = LAYOUTS[layout]
    result = train(config(tmp_path / "out", corpus_dir, cache_root, **kw))
    assert_same_function(result.history,
                         one_worker({k: v for k, v in kw.items() if k in MODEL_KEYS}))
