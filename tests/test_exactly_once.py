"""Exactly once, end to end: the sample ids the ranks report training on in one epoch are
the training set, each once, including an epoch's short last step in which some ranks
have no sample at all (and must still join the gradient all-reduce)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from raylm import TrainConfig, train
from raylm.runtime.input_checks import check_inputs
from raylm.runtime.prepare import prepare_data
from tests.conftest import CPUS, TINY_GPT2

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)

WORKERS = 4
# An epoch of 42 samples (run_clm's --max_train_samples: the first 42 of the training
# split): 10 full steps of 4 ranks, then a short last step of 2, in which 2 ranks have
# no sample at all.
SAMPLES = 42


def config(out, data, cache_root, workers):
    return TrainConfig(model_type="gpt2", config_overrides=TINY_GPT2, train_file=[str(data)],
                       block_size=32, data_cache_dir=cache_root, output_dir=str(out),
                       num_train_epochs=1, max_train_samples=SAMPLES,
                       per_device_train_batch_size=1,
                       gradient_accumulation_steps=WORKERS // workers, num_workers=workers,
                       logging_steps=1, save_steps=1000, disable_tqdm=True, do_eval=False,
                       log_sample_ids=True, learning_rate=1e-3, cpus_per_worker=CPUS)


def test_one_epoch_sees_every_training_sample_once(ray_cluster, corpus_dir, cache_root,
                                                   tmp_path):
    data = corpus_dir / "comedy_of_errors.txt"
    cfg = config(tmp_path / "probe", data, cache_root, WORKERS)
    train_ids = prepare_data(cfg, check_inputs(cfg, check_output_dir=False)).train_ids
    assert len(train_ids) == SAMPLES and SAMPLES % WORKERS

    result = train(config(tmp_path / "four", data, cache_root, WORKERS))
    with open(os.path.join(result.output_dir, "samples.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    seen = [i for s in steps for rank in s["ranks"] for i in rank]
    assert sorted(seen) == sorted(train_ids.tolist())
    assert len(steps) == len(result.history) == -(-len(train_ids) // WORKERS)
    assert any(len(rank) == 0 for rank in steps[-1]["ranks"])  # the short last step

    # The same epoch on one rank (same global batch) gives the same losses, last step too.
    one = train(config(tmp_path / "one", data, cache_root, 1))
    np.testing.assert_allclose([h["loss"] for h in result.history],
                               [h["loss"] for h in one.history], rtol=1e-5)
