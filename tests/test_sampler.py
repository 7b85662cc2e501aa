"""The seeded global order: layout-independent global batches, each sample once per epoch."""

from __future__ import annotations

import numpy as np
import pytest

from raylm.data.sampler import GlobalBatchSampler, split_train_eval, step_schedule


def test_each_sample_exactly_once_per_epoch_whatever_the_layout():
    ids = np.arange(103)  # not a multiple of the global batch: the last batch is short
    sampler = GlobalBatchSampler(ids, global_batch_size=12, seed=7)
    assert sampler.steps_per_epoch == 9
    for dp, mb in [(1, 12), (2, 3), (3, 2), (4, 1)]:
        for epoch in range(2):
            seen = []
            for step in range(epoch * 9, epoch * 9 + 9):
                for rank_batches in step_schedule(sampler.global_batch(step), dp, mb):
                    for b in rank_batches:
                        assert len(b) <= mb
                        seen.extend(b.tolist())
            assert sorted(seen) == ids.tolist()


def test_global_batch_does_not_depend_on_layout_and_epochs_differ():
    sampler = GlobalBatchSampler(np.arange(50), 10, seed=1)
    batch = sampler.global_batch(3)
    for dp, mb in [(1, 10), (2, 5), (5, 1)]:
        flat = np.concatenate([b for r in step_schedule(batch, dp, mb) for b in r])
        assert flat.tolist() == batch.tolist()
    assert not np.array_equal(sampler.epoch_order(0), sampler.epoch_order(1))
    assert np.array_equal(sampler.epoch_order(1), GlobalBatchSampler(np.arange(50), 10, 1).epoch_order(1))
    assert not np.array_equal(sampler.epoch_order(0), GlobalBatchSampler(np.arange(50), 10, 2).epoch_order(0))


@pytest.mark.parametrize("n,pct,expect", [(100, 5, 5), (10, 5, 1), (100, 0, 0), (1, 50, 0)])
def test_validation_split(n, pct, expect):
    train, held = split_train_eval(n, pct)
    assert len(held) == expect
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(n))
    assert np.array_equal(held, split_train_eval(n, pct)[1])
