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
