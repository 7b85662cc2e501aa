"""A lost rank under pipeline and tensor parallelism: the survivors carry on in memory
under a re-planned layout, reading their shards of the state from the live copies
(data-parallel replicas of the stages or shards) through the object store.

Four ranks of a tiny GPT-2 (dp=2 x pp=2, dp=2 x tp=2), one killed mid-step; the three
survivors hold a copy of every stage or shard, so the run goes on at dp=1 on two of them
(the flags fix pp x tp) with nothing read from disk. Each run checks: per-step losses and
gradient norms equal single-process training's within 1e-5; every sample of every step
trained exactly once; no committed step redone; nothing left running. A rank that dies
while the survivors rebuild makes the run fall back to the latest checkpoint.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from raylm import TrainConfig, train
from raylm.runtime.faults import inject
from tests.conftest import TINY_GPT2, TINY_GPT2_DROPOUT
from tests.test_elastic import Watch, assert_nothing_left, samples_per_step

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)

STEPS = 6


def layout_config(out, corpus, cache_root, **kw) -> TrainConfig:
    base = dict(model_type="gpt2", config_overrides=TINY_GPT2, train_file=[str(corpus)],
                block_size=32, data_cache_dir=cache_root, output_dir=str(out), max_steps=STEPS,
                save_steps=2, logging_steps=1, disable_tqdm=True, learning_rate=1e-3,
                cpus_per_worker=1, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, do_eval=False, log_sample_ids=True)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def single(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    """Single-process training on the same global batch of 8."""
    out = tmp_path_factory.mktemp("single") / "out"
    result = train(layout_config(out, corpus_dir, cache_root, num_workers=1,
                                 gradient_accumulation_steps=4))
    return {"history": {h["step"]: h for h in result.history},
            "samples": samples_per_step(out)}


@pytest.fixture(scope="module")
def single_with_dropout(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    """``single`` with dropout on (masks per sample, raylm.models.dropout)."""
    out = tmp_path_factory.mktemp("single-dropout") / "out"
    result = train(layout_config(out, corpus_dir, cache_root, num_workers=1,
                                 gradient_accumulation_steps=4,
                                 config_overrides=TINY_GPT2_DROPOUT))
    return {"history": {h["step"]: h for h in result.history},
            "samples": samples_per_step(out)}


def assert_single_process_run(result, out, single) -> None:
    steps = list(range(1, STEPS + 1))
    got = {h["step"]: h for h in result.history}
    assert sorted(got) == steps
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([got[s][key] for s in steps],
                                   [single["history"][s][key] for s in steps], rtol=1e-5,
                                   err_msg=key)
    assert samples_per_step(out) == single["samples"]


def test_a_survivor_blocked_on_a_peer_that_left_is_released(single, ray_cluster, corpus_dir,
                                                            cache_root, tmp_path, caplog):
    """dp=2 x tp=2, rank 1 dies in its gradient sync: rank 2 waits in its own sync on
    rank 0, which failed and left the group without its connections closing (other
    objects still hold that group). Rank 2 is released from its peers' connections, not
    counted lost: all three survivors answer, and two of them are re-laid out."""
    caplog.set_level("INFO", logger="raylm")
    watch, out = Watch(), tmp_path / "out"
    with inject({"rank": 1, "step": 3, "phase": "sync"}):
        result = train(layout_config(out, corpus_dir, cache_root, num_workers=4, tp=2),
                       callbacks=(watch,))
    [failure] = [line for line in caplog.text.splitlines() if "rank failure at step 4" in line]
    assert re.search(r"; dead: rank 1 \(pid \d+, node \w+\)$", failure), failure
    assert "re-laid out in memory on 2 rank(s)" in caplog.text
    assert [h["world_size"] for h in result.history] == [4, 4, 4, 2, 2, 2]
    assert_single_process_run(result, out, single)
    assert_nothing_left(watch)


@pytest.mark.parametrize("layout,action", [(dict(pp=2), "die"), (dict(tp=2), "die"),
                                           (dict(pp=2), "freeze")],
                         ids=["dp2xpp2", "dp2xtp2", "dp2xpp2-frozen"])
def test_a_lost_rank_is_re_laid_out_in_memory(layout, action, single, ray_cluster,
                                              corpus_dir, cache_root, tmp_path, caplog):
    """The last rank dies (or freezes: SIGSTOP, its peers blocked in the step's
    collectives until its silent heartbeat has it ended) after its gradient sync at
    step 4: the step commits nowhere, and the survivors are re-laid out in memory."""
    caplog.set_level("INFO", logger="raylm")
    watch = Watch()
    out = tmp_path / "out"
    watching = (dict(heartbeat_interval_s=0.3, heartbeat_timeout_s=3.0)
                if action == "freeze" else {})
    with inject({"rank": 3, "step": 3, "phase": "update", "action": action}):
        result = train(layout_config(out, corpus_dir, cache_root, num_workers=4, **layout,
                                     **watching), callbacks=(watch,))
    log = caplog.text
    assert result.failures == 1
    if action == "freeze":
        assert "no heartbeat for 3 s" in log and "ending rank 3 (pid" in log
    shape = "pp=2 x tp=1" if "pp" in layout else "pp=1 x tp=2"
    assert f"re-planned: 2 rank(s): dp=1 x {shape}" in log
    assert "re-laid out in memory on 2 rank(s)" in log and "0 committed steps redone" in log
    assert "restoring" not in log
    assert [h["world_size"] for h in result.history] == [4, 4, 4, 2, 2, 2]
    assert_single_process_run(result, out, single)
    assert_nothing_left(watch)


def test_a_pipeline_re_laid_out_with_dropout_on_keeps_its_masks(
        single_with_dropout, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """dp=2 x pp=2 with dropout on, rank 3 lost at step 4: re-laid out at dp=1 x pp=2,
    the run draws the masks one process draws (per sample, keyed by module name), so its
    losses and gradient norms stay single-process training's."""
    caplog.set_level("INFO", logger="raylm")
    watch, out = Watch(), tmp_path / "out"
    with inject({"rank": 3, "step": 3, "phase": "update"}):
        result = train(layout_config(out, corpus_dir, cache_root, num_workers=4, pp=2,
                                     config_overrides=TINY_GPT2_DROPOUT), callbacks=(watch,))
    assert result.failures == 1 and "re-laid out in memory on 2 rank(s)" in caplog.text
    assert [h["world_size"] for h in result.history] == [4, 4, 4, 2, 2, 2]
    assert_single_process_run(result, out, single_with_dropout)
    assert_nothing_left(watch)


def test_a_rank_lost_during_the_recovery_falls_back_to_the_checkpoint(
        single, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """Rank 3 dies at step 4; then rank 0 of the new group dies while the survivors
    rebuild: their state is no longer whole, so the run restarts from step 2's
    checkpoint (one step redone) and still computes single-process training's losses."""
    caplog.set_level("INFO", logger="raylm")
    watch = Watch()
    out = tmp_path / "out"
    with inject({"rank": 3, "step": 3, "phase": "update"},
                {"rank": 0, "step": 3, "phase": "recovery", "generation": 2}):
        result = train(layout_config(out, corpus_dir, cache_root, num_workers=4, pp=2),
                       callbacks=(watch,))
    log = caplog.text
    assert result.failures == 2
    assert "during the recovery" in log
    assert "checkpoints/step-00000002" in log and "1 step(s) will be redone" in log
    assert_single_process_run(result, out, single)
    assert_nothing_left(watch)


@pytest.mark.parametrize("layout", [dict(pp=2), dict(tp=2)], ids=["pp2", "tp2"])
def test_a_model_parallel_layout_grows_onto_room_in_memory(
        layout, single, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """dp=1 x pp=2 (or x tp=2) on 2 of the 4 CPUs with --max_workers 4: two newcomers
    (under tensor parallelism a group sharing one bundle, so one node) warm up while it
    trains, then the live ranks export their state and all four rebuild as dp=2,
    reading it from the object store. Losses and gradient norms are single-process
    training's, every sample once, nothing redone."""
    caplog.set_level("INFO", logger="raylm")
    watch = Watch(grow_from=1)  # looks for room at every step boundary
    out = tmp_path / "out"
    result = train(layout_config(out, corpus_dir, cache_root, num_workers=2, max_workers=4,
                                 gradient_accumulation_steps=4, **layout),
                   callbacks=(watch,))
    log = caplog.text
    assert "grew in memory to 4 rank(s)" in log and "re-laid out from the live" in log
    shape = "pp=2 x tp=1" if "pp" in layout else "pp=1 x tp=2"
    assert f"re-planned: 4 rank(s): dp=2 x {shape}" in log
    sizes = [h["world_size"] for h in result.history]
    assert sizes[0] == 2 and sizes[-1] == 4, sizes
    assert result.failures == 0 and "restoring" not in log
    assert_single_process_run(result, out, single)
    assert_nothing_left(watch)
