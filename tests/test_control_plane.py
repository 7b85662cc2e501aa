"""The driver's per-rank logic at cluster sizes this machine cannot start: the pieces a
failure or a join runs over every rank's answer, fed 1,000 and 10,000 ranks' worth of
plain data (no Ray, no process per rank)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from raylm.checkpoint.memory import merge, uncovered

ROWS, COLS = 2, 4  # each shard of a tensor: rows of dim 0


def exports(dp: int, replicas: int, keys: int, step: int = 7, skip=()) -> list:
    """What ``dp x replicas`` ranks export after a step: ZeRO shards (dp rank d holds
    rows [d * ROWS, (d + 1) * ROWS) of every tensor), each held by ``replicas`` ranks
    (data-parallel copies of the shard); ranks in ``skip`` are lost."""
    props = TensorProperties(dtype=torch.float32)
    out = []
    for r in range(dp * replicas):
        if r in skip:
            continue
        d = r % dp
        offsets, sizes = torch.Size([d * ROWS, 0]), torch.Size([ROWS, COLS])
        sd, where = {}, {}
        for k in range(keys):
            sd[f"t{k}"] = TensorStorageMetadata(props, torch.Size([dp * ROWS, COLS]),
                                                [ChunkStorageMetadata(offsets, sizes)])
            where[MetadataIndex(f"t{k}", offsets)] = (f"bucket of rank {r}", f"t{k}")
        md = Metadata(state_dict_metadata=sd, planner_data={})
        md.storage_data = where
        out.append({"metadata": md, "node_id": f"node {r // 8}", "step": step})
    return out


@pytest.mark.parametrize("dp, replicas, keys", [(1000, 1, 20), (5000, 2, 2)],
                         ids=["1000 ranks", "10000 ranks"])
def test_a_merge_lists_each_chunk_once_with_every_holder(dp, replicas, keys):
    state = merge(exports(dp, replicas, keys))
    assert state.step == 7 and uncovered(state) == []
    for k in range(keys):
        chunks = state.metadata.state_dict_metadata[f"t{k}"].chunks
        assert [c.offsets[0] for c in chunks] == [d * ROWS for d in range(dp)]
    holders = state.holders[MetadataIndex("t0", torch.Size([3 * ROWS, 0]))]
    assert [ref for ref, _ in holders] == [(f"bucket of rank {3 + dp * i}", "t0")
                                           for i in range(replicas)]
    assert len(state.holders) == dp * keys


def test_a_shard_with_no_live_holder_is_uncovered_and_one_replica_is_enough():
    dp = 1000
    lost = merge(exports(dp, 1, 3, skip={417}))
    assert uncovered(lost) == ["t0", "t1", "t2"]
    kept = merge(exports(dp, 2, 3, skip={417}))  # its replica, rank 1417, is alive
    assert uncovered(kept) == []
    assert [ref for ref, _ in kept.holders[MetadataIndex("t1", torch.Size([417 * ROWS, 0]))]] \
        == [("bucket of rank 1417", "t1")]


def test_ranks_at_different_steps_do_not_merge():
    late = exports(1000, 1, 2)
    late[-1]["step"] = 6
    with pytest.raises(ValueError, match="different steps"):
        merge(late)


# -- a step's answers under the ranks' protocol (raylm.runtime.protocol.StepTable) ----------


def step_table(n: int, seed: int = 0):
    """Every rank's row of one step at ``n`` ranks: the last of every 4 (a pipeline's last
    stage) computes the loss; rank n // 3 is the slowest."""
    import numpy as np

    from raylm.runtime.protocol import StepResult, StepTable

    rng = np.random.default_rng(seed)
    results = [StepResult(loss=2.5, tokens=4096, local_tokens=64, has_loss=r % 4 == 3,
                          learning_rate=1e-3, grad_norm=1.25, overflow=False,
                          peak_rss_bytes=2**30 + r, data_wait_s=float(rng.random()) / 100,
                          forward_backward_s=0.5, grad_sync_s=0.1, clip_s=0.01,
                          optimizer_s=None if r == 0 else 0.02,
                          step_s=0.7 + (0.5 if r == n // 3 else 0.0),
                          boundary_idle_s=None if r < 2 else 0.001 * r, peer_wait_s=0.11)
               for r in range(n)]
    return results, StepTable.of(results)


@pytest.mark.parametrize("n", [1000, 10000], ids=["1000 ranks", "10000 ranks"])
def test_a_step_of_every_rank_is_read_from_one_table(n):
    from raylm.runtime.profiling import slowest_breakdown

    results, table = step_table(n)
    assert len(table) == n
    assert table.loss_row() == results[3]  # (the first rank that computed the loss)
    assert table.result(n - 1) == results[n - 1]  # (None, ints and flags come back)
    parts = slowest_breakdown(table)
    assert parts["forward_backward_s"] == 0.5 and parts["optimizer_s"] == 0.02
    assert parts["boundary_idle_s"] == table.least("boundary_idle_s") == 0.002
    assert table.col("peak_rss_bytes").astype("int64").tolist() == \
        [r.peak_rss_bytes for r in results]


def test_each_ranks_peers_median_matches_the_definition():
    """Groups of 1 (no peers), 2, 3 and 8 ranks, ties included, against the median of
    each rank's peers taken one by one."""
    import statistics

    import numpy as np

    from raylm.runtime.health import peers_median

    rng = np.random.default_rng(1)
    sizes = [1, 2, 3, 8] * 80
    peers = np.repeat(np.arange(len(sizes)), sizes)
    own = rng.integers(0, 5, len(peers)).astype(float) / 10
    got = peers_median(own, peers)
    for r in range(len(own)):
        others = [own[k] for k in np.flatnonzero(peers == peers[r]) if k != r]
        if others:
            assert got[r] == pytest.approx(statistics.median(others))
        else:
            assert np.isnan(got[r])


@pytest.mark.parametrize("n", [1000, 10000], ids=["1000 ranks", "10000 ranks"])
def test_the_straggler_among_many_ranks_is_found(n):
    import numpy as np

    from raylm.runtime.health import Stragglers

    own = np.full(n, 0.5)
    own[n // 3] = 1.5
    peers = np.arange(n) % 8  # (8 pipeline stages x tensor shards, each n / 8 replicas)
    s = Stragglers(factor=2, steps=3)
    for _ in range(2):
        assert s.observe(own, peers)[:2] == (n // 3, 1.0)
    assert s.observe(own, peers)[2] == [(n // 3, 0.5)]


def test_a_nan_loss_stays_a_number_and_an_unknown_time_is_none():
    """A diverged step's NaN loss is a NaN in the record (the log prints it); NaN in an
    optional column (no optimizer step yet, no boundary) is None."""
    import math

    results, table = step_table(8)
    table.values[:, 0] = float("nan")  # (the loss column)
    row = table.loss_row()
    assert math.isnan(row.loss) and row.optimizer_s == 0.02
    assert table.result(0).optimizer_s is None and table.result(0).boundary_idle_s is None


def test_the_history_grows_by_a_record_a_step_not_by_a_rank(tmp_path):
    """Each step's record lists every rank's peak memory; the records of steps in which
    no peak changed share one list (10,000 ranks x 100,000 steps would otherwise hold
    a billion numbers), and a changed peak is recorded as it is."""
    import numpy as np

    from raylm.config import TrainConfig
    from raylm.data.sampler import GlobalBatchSampler
    from raylm.models.loading import ModelSpec
    from raylm.plan.dims import ParallelDims
    from raylm.plan.layout import Plan
    from raylm.runtime.metrics import MetricsLog, Progress
    from raylm.runtime.policy import RunRecord
    from raylm.runtime.protocol import COLUMNS
    from raylm.runtime.reporting import Reporter

    n = 10000
    plan = Plan(ParallelDims(dp=n), micro_batch_size=1, global_batch_size=n,
                cpus_per_worker=1)
    record = RunRecord(plan=plan)
    spec = ModelSpec(config=None, pretrained_path=None, tokenizer_dir=str(tmp_path),
                     vocab_size=64, objective="clm")
    report = Reporter(TrainConfig(train_file=["a.txt"], output_dir=str(tmp_path),
                                  disable_tqdm=True), record, MetricsLog(str(tmp_path)),
                      Progress(3, 0, True), 3, spec, 8, str(tmp_path))
    sampler = GlobalBatchSampler(np.arange(3 * n), n, seed=0)
    results, table = step_table(n)
    for grown in (False, False, True):
        if grown:
            table.values[n - 1, COLUMNS.index("peak_rss_bytes")] += 4096
        record.step += 1
        report.step(table, table.loss_row(), 1.0, 0.0, None, None, False, sampler, plan)
    first, second, third = (h["peak_rss_bytes"] for h in record.history)
    assert first is second and first == [r.peak_rss_bytes for r in results]
    assert third is not second and third[-1] == results[-1].peak_rss_bytes + 4096
    assert third[:-1] == second[:-1]
