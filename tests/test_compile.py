"""--torch_compile on the real Ray runtime: each block's forward compiled per rank
(raylm.parallel.compile), composed with tensor parallelism, ZeRO-3, activation
checkpointing and a pipeline, and the whole forward and loss (--torch_compile_scope
model) under data parallelism with ZeRO-1, against the single-process fp32 run (eager)
at the parity tolerances of the eager layouts: inductor's kernels compute the same sums
in another order, fp32 rounding only. The compile itself is real (each rank reports what
it compiled and the graphs torch.compile made); on this CPU it takes tens of seconds per
rank, so three runs cover the compositions."""

from __future__ import annotations

import json
import os

import pytest

from raylm import train
from tests.test_pipeline import assert_parity, assert_recomputed
from tests.test_tensor_layouts import reference, tp_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)

RUNS = [  # (dp, pp, tp, ZeRO stage, model, activation checkpointing)
    (2, 1, 2, 3, "gpt2", "full"),
    (1, 2, 1, 0, "llama", "selective"),
    (2, 1, 1, 1, "gpt2", "none"),  # --torch_compile_scope model: the whole forward
]


@pytest.mark.parametrize("dp,pp,tp,stage,model,recompute", RUNS,
                         ids=[f"dp{d}-pp{p}-tp{t}-zero{z}-{m}-{r}" for d, p, t, z, m, r in RUNS])
def test_compiled_blocks_match_single_process(dp, pp, tp, stage, model, recompute, reference,
                                              ray_cluster, corpus_dir, cache_root, tmp_path):
    whole = pp == 1 and tp == 1 and stage != 3 and recompute == "none"
    cfg = tp_config(tmp_path / "out", corpus_dir, cache_root, model, dp=dp, pp=pp, tp=tp,
                    num_workers=dp * pp * tp, zero_stage=stage,
                    activation_checkpointing=recompute, torch_compile=True,
                    torch_compile_scope="model" if whole else "blocks")
    result = train(cfg)
    assert_parity(result, reference(model))
    assert_recomputed(result.output_dir, recompute)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        ranks = json.load(f)["ranks"]
    # A rank that holds the whole model compiled its forward and its loss (two graphs,
    # and the forward again without gradients for evaluation, and for inputs of another
    # kind); else every rank compiled its blocks: one graph shared by its identical
    # blocks (a few more where a block's inputs differ in kind), not one per block.
    assert all(r["compiled"] == ("model" if whole else "blocks") for r in ranks), ranks
    assert all(1 <= r["compiled_graphs"] <= (4 if whole else 2) for r in ranks), ranks
