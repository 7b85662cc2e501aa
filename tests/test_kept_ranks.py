"""raylm.keep_ranks: the runs of one driver share rank processes when their shape fits,
with the results of fresh processes; a run of more ranks starts only those it lacks;
a run of fewer ranks leaves the rest idle for the next; kept processes stop when
released, when a run of another shape comes, and before data must be tokenized if they
leave Ray Data's tasks no CPU."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

import raylm
from raylm import TrainConfig, train
from raylm.runtime import kept
from tests.conftest import CPUS, RAY_CPUS, SHAKESPEARE, TINY_GPT2
from tests.test_elastic import _gone

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)


class Pids:
    def __init__(self):
        self.pids = set()

    def on_step_end(self, driver, step, record):
        self.pids.update(driver.worker_pids)


def _all_gone(pids, timeout_s: float = 30.0) -> bool:
    deadline = time.time() + timeout_s
    while not all(_gone(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    return all(_gone(p) for p in pids)


def _run(out, files, cache_root, workers=2, cpus=CPUS):
    """3 steps of global batch 4 (2 per rank, accumulated on one rank)."""
    pids = Pids()
    result = train(TrainConfig(
        model_type="gpt2", config_overrides=TINY_GPT2, train_file=[str(f) for f in files],
        block_size=32, data_cache_dir=cache_root, output_dir=str(out), max_steps=3,
        logging_steps=1, save_steps=1000, disable_tqdm=True, do_eval=False,
        num_workers=workers, cpus_per_worker=cpus, per_device_train_batch_size=2,
        gradient_accumulation_steps=2 // workers,
        learning_rate=1e-3), callbacks=(pids,))
    return result, pids.pids


def test_kept_ranks_train_again_alike_and_stop_when_released_or_outgrown(
        ray_cluster, corpus_dir, cache_root, tmp_path):
    kept.release()  # (what this module's earlier runs left)
    with raylm.keep_ranks():
        first, first_pids = _run(tmp_path / "a", [corpus_dir], cache_root)
        second, second_pids = _run(tmp_path / "b", [corpus_dir], cache_root)
    # The second run ran in the first one's processes, and trained as they did.
    assert len(first_pids) == 2 and second_pids == first_pids
    np.testing.assert_allclose([h["loss"] for h in second.history],
                               [h["loss"] for h in first.history], rtol=1e-6)
    assert second.metrics["world_size"] == 2

    # A run of fewer ranks takes one of them and leaves the other idle; the next run of
    # two gets both back.
    alone, alone_pids = _run(tmp_path / "c", [corpus_dir], cache_root, workers=1)
    assert len(alone_pids) == 1 and alone_pids < first_pids
    assert not any(_gone(p) for p in first_pids)
    np.testing.assert_allclose([h["loss"] for h in alone.history],
                               [h["loss"] for h in first.history], rtol=1e-5)
    again, again_pids = _run(tmp_path / "c2", [corpus_dir], cache_root)
    assert again_pids == first_pids
    np.testing.assert_allclose([h["loss"] for h in again.history],
                               [h["loss"] for h in first.history], rtol=1e-6)

    # Data not in the cache yet, with CPUs left beside the kept ranks: Ray Data tokenizes
    # it there, and the run takes a kept rank.
    fresh, fresh_pids = _run(tmp_path / "d", [_play(tmp_path, "lovers_complaint.txt")],
                             cache_root, workers=1)
    assert fresh_pids < first_pids
    assert fresh.history[-1]["loss"] < fresh.history[0]["loss"]

    # Released (as at the end of the outermost keep_ranks block): stopped.
    assert not any(_gone(p) for p in first_pids)
    kept.release()
    assert _all_gone(first_pids)

    # A kept rank that holds every CPU stops before Ray Data tokenizes new data (the
    # tasks need a CPU), and the run starts fresh.
    full, full_pids = _run(tmp_path / "f", [corpus_dir], cache_root, workers=1,
                           cpus=RAY_CPUS)
    other, other_pids = _run(tmp_path / "g", [_play(tmp_path, "passionate_pilgrim.txt")],
                             cache_root, workers=1, cpus=RAY_CPUS)
    assert not other_pids & full_pids and _all_gone(full_pids)
    assert other.history[-1]["loss"] < other.history[0]["loss"]
    kept.release()
    assert _all_gone(other_pids)


def _play(tmp_path, name):
    """A directory holding one play of the corpus (its blocks not in the cache yet)."""
    d = tmp_path / name.split(".")[0]
    d.mkdir()
    shutil.copy(SHAKESPEARE / name, d / name)
    return d


def _freeze_counts(rank, port, queue):
    import gc

    from raylm.runtime.worker import RankWorker

    before = gc.get_freeze_count()
    worker = RankWorker(0, 1, 1)
    frozen = gc.get_freeze_count()
    worker.reset(0, 1, 1)  # (a kept process becomes a new run's rank)
    queue.put((rank, (before, frozen, gc.get_freeze_count())))


def test_a_rank_sets_its_imports_aside_from_the_collector_once():
    """A rank freezes what its imports made (gc.freeze) when it starts, so its full
    collections (leaving a group, a reset) scan only what runs made; a kept process's
    reset freezes nothing more (it would freeze the last run's groups, never closed)."""
    from tests.gloo_ranks import run_ranks

    results, _ = run_ranks(_freeze_counts, 1)
    before, frozen, after_reset = results[0]
    assert before == 0 and frozen > 100_000  # (torch's and transformers' objects)
    assert after_reset <= frozen  # (frozen objects freed by their counts leave it)
