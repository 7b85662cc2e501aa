"""Loss parity: every data-parallel layout reproduces single-process training.

Same data, same seed, fp32: per-step losses equal a plain PyTorch loop within 1e-5
relative, and the saved weights match the reference's.
"""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import pytest
from safetensors.torch import load_file

from raylm import TrainConfig, train
from raylm.runtime.input_checks import check_inputs
from raylm.runtime.prepare import prepare_data
from tests.conftest import CPUS, TINY_GPT2
from tests.numerics import assert_steps_match, assert_weights_match
from tests.reference import single_process_reference
from tests.test_pipeline import assert_recomputed

STEPS = 6
GLOBAL_BATCH = 8


def tiny_config(out, corpus, cache_root, **kw) -> TrainConfig:
    base = dict(model_type="gpt2", config_overrides=TINY_GPT2, train_file=[str(corpus)],
                block_size=32, data_cache_dir=cache_root, output_dir=str(out), max_steps=STEPS,
                logging_steps=1, save_steps=1000, disable_tqdm=True, learning_rate=1e-3,
                warmup_steps=2, per_device_train_batch_size=2, cpus_per_worker=CPUS)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def reference(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("ref"), corpus_dir, cache_root,
                      gradient_accumulation_steps=4)
    inputs = check_inputs(cfg)
    data = prepare_data(cfg, inputs)
    return single_process_reference(cfg, inputs.spec, data.train, data.train_ids,
                                    GLOBAL_BATCH, STEPS)


# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_data_parallel_matches_single_process": {"1x4", "2x2-selective"},
}

# (workers, micro-batches per worker, activation checkpointing: recomputing the blocks
# in backward is the same arithmetic, so the same losses)
@pytest.mark.parametrize("workers,accum,recompute", [(1, 4, "none"), (2, 2, "selective"),
                                                     (4, 1, "full")],
                         ids=["1x4", "2x2-selective", "4x1-full"])
def test_data_parallel_matches_single_process(workers, accum, recompute, reference,
                                              ray_cluster, corpus_dir, cache_root, tmp_path,
                                              caplog):
    ref_losses = reference.losses
    cfg = tiny_config(tmp_path / "out", corpus_dir, cache_root, num_workers=workers,
                      gradient_accumulation_steps=accum, activation_checkpointing=recompute)
    caplog.set_level("INFO", logger="raylm")
    result = train(cfg)
    # The log says where the ranks run and their memory in a line each, not per rank.
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    [placed] = [l for l in lines if l.startswith("placed ")]
    node = ray_cluster.get_runtime_context().get_node_id()[:8]
    assert placed.startswith(f"placed {workers} rank(s) on 1 node(s): node {node} (")
    assert placed.endswith(" ranks " + ("0" if workers == 1 else f"0-{workers - 1}"))
    assert sum(l.startswith("memory per rank") for l in lines) == 1
    assert not any(re.match(r"(memory )?rank \d+[: ]", l) for l in lines), lines

    assert_steps_match(result.history, reference, STEPS, label=f"{workers}x{accum}")
    losses = [h["loss"] for h in result.history]
    # The losses actually moved: parity of a constant would prove nothing.
    assert losses[-1] < losses[0] - 0.05

    saved = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert saved, "no weights saved"
    # safetensors keeps one of tied weights (GPT-2's lm_head is wte)
    exact = {k: v for k, v in reference.exact.items() if k in saved}
    assert_weights_match(saved, reference.state, exact, reference.lr_sum,
                         label=f"{workers}x{accum}", allowance=reference.allowance)

    # metrics.jsonl holds the same per-step losses, and an eval entry at the end.
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in train_records], ref_losses, rtol=1e-5)
    for r in train_records:
        assert r["tokens_per_second"] > 0 and r["learning_rate"] >= 0
    evals = [r for r in records if "eval_loss" in r]
    assert evals and evals[-1]["perplexity"] == pytest.approx(np.exp(evals[-1]["eval_loss"]))
    assert result.metrics["world_size"] == workers
    assert_recomputed(result.output_dir, recompute)
