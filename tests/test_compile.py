"""--torch_compile on the real Ray runtime: each block's forward compiled per rank
(raylm.parallel.compile), composed with tensor parallelism, ZeRO-3, activation
checkpointing and a pipeline, against the single-process fp32 run (eager) at the parity
tolerances of the eager layouts: inductor's kernels compute the same sums in another
order, fp32 rounding only. The compile itself is real (each rank reports the graphs
torch.compile made); on this CPU it takes tens of seconds per rank, so two runs cover
the compositions."""

from __future__ import annotations

import json
import os

import pytest

from raylm import train
from tests.test_pipeline import assert_parity, assert_recomputed
from tests.test_tensor_layouts import reference, tp_config  # noqa: F401 (fixture)

RUNS = [  # (dp, pp, tp, ZeRO stage, model, activation checkpointing)
    (2, 1, 2, 3, "gpt2", "full"),
    (1, 2, 1, 0, "llama", "selective"),
]


@pytest.mark.parametrize("dp,pp,tp,stage,model,recompute", RUNS,
                         ids=[f"dp{d}-pp{p}-tp{t}-zero{z}-{m}-{r}" for d, p, t, z, m, r in RUNS])
def test_compiled_blocks_match_single_process(dp, pp, tp, stage, model, recompute, reference,
                                              ray_cluster, corpus_dir, cache_root, tmp_path):
    cfg = tp_config(tmp_path / "out", corpus_dir, cache_root, model, dp=dp, pp=pp, tp=tp,
                    num_workers=dp * pp * tp, zero_stage=stage,
                    activation_checkpointing=recompute, torch_compile=True)
    result = train(cfg)
    assert_parity(result, reference(model))
    assert_recomputed(result.output_dir, recompute)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        ranks = json.load(f)["ranks"]
    # every rank compiled its blocks: one graph shared by its identical blocks (a few
    # more where a block's inputs differ in kind), not one per block
    assert all(1 <= r["compiled_graphs"] <= 2 for r in ranks), ranks
