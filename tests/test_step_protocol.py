"""--step_protocol ranks: the ranks run the steps between the driver's boundaries on their
own, derive their samples from the step number and agree each commit among themselves.

The guarantees of the driver's protocol hold: losses and gradient norms of single-process
training at 2, 4 and 8 ranks, windows cut at every evaluation and checkpoint; each sample
once and the unchanged losses with a rank killed or frozen mid-step.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from raylm import train
from raylm.runtime.faults import inject
from tests.numerics import assert_steps_match
from tests.test_elastic import STEPS, WATCH, elastic_config, samples_per_step
from tests import test_parity
from tests.test_parity import STEPS as PARITY_STEPS, tiny_config

reference = test_parity.reference  # (the single-process run, as a fixture here too)

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)


@pytest.mark.parametrize("layout", [dict(num_workers=2, gradient_accumulation_steps=2),
                                    dict(num_workers=4, pp=2, gradient_accumulation_steps=2),
                                    dict(num_workers=8, per_device_train_batch_size=1)],
                         ids=["dp2", "dp2xpp2", "dp8"])
def test_the_ranks_protocol_matches_single_process(layout, reference, ray_cluster, corpus_dir,
                                                   cache_root, tmp_path, caplog):
    """An evaluation after step 2 and checkpoints every 4 steps cut the run into windows
    (steps 1-2, 3-4, 5-6): parity throughout, the driver's calls one per window."""
    caplog.set_level(logging.DEBUG, logger="raylm")
    cfg = tiny_config(tmp_path / "out", corpus_dir, cache_root, step_protocol="ranks",
                      eval_strategy="steps", eval_steps=2, do_train=True, do_eval=True, save_steps=4,
                      **layout)
    result = train(cfg)
    assert_steps_match(result.history, reference, PARITY_STEPS, label=str(layout))
    windows = [r.getMessage() for r in caplog.records
               if r.getMessage().startswith("the ranks run steps")]
    assert windows == ["the ranks run steps 1-2", "the ranks run steps 3-4",
                       "the ranks run steps 5-6"]
    assert (tmp_path / "out" / "checkpoints" / "step-00000004").is_dir()
    evals = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")
             if '"eval_loss"' in line]
    assert [e["step"] for e in evals][:2] == [2, 4]


@pytest.fixture(scope="module")
def unchanged(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("unchanged") / "out"
    result = train(elastic_config(out, corpus_dir, cache_root, step_protocol="ranks"))
    return {"losses": {h["step"]: h["loss"] for h in result.history},
            "samples": samples_per_step(out)}


@pytest.mark.parametrize("fault", [{"rank": 1, "step": 4, "phase": "sync"},
                                   {"rank": 0, "step": 4, "phase": "commit"},
                                   {"rank": 0, "step": 5, "phase": "agreed"},
                                   {"rank": 1, "step": 4, "phase": "step",
                                    "action": "freeze"}],
                         ids=["killed-in-sync", "rank-0-killed-in-commit",
                              "rank-0-killed-before-answering", "frozen"])
def test_a_lost_rank_keeps_every_sample_once_and_the_losses(
        fault, unchanged, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """3 ranks; one dies in its gradient sync (the step commits nowhere, and runs again
    on the survivors), rank 0 (the one that answers the driver) dies applying a step
    the others apply (it counts), or before answering for step 6, which the others
    commit (its record comes from a survivor's copy, and the checkpoint due after it
    is written), one freezes before its forward (its heartbeat stops; it is ended): the survivors carry on
    in memory with the unchanged run's losses, every step's samples once."""
    caplog.set_level("INFO", logger="raylm")
    out = tmp_path / "out"
    with inject(fault):
        result = train(elastic_config(out, corpus_dir, cache_root, step_protocol="ranks",
                                      **WATCH))
    assert result.failures == 1
    assert "shrank in memory to 2 rank(s)" in caplog.text
    assert "0 committed steps redone" in caplog.text and "restoring" not in caplog.text
    losses = {h["step"]: h["loss"] for h in result.history}
    assert sorted(losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                               [unchanged["losses"][s] for s in sorted(losses)], rtol=1e-5)
    assert samples_per_step(out) == unchanged["samples"]
    for ids in unchanged["samples"].values():
        assert len(ids) == len(set(ids))
    assert [h["world_size"] for h in result.history][-1] == 2
    if fault["phase"] == "agreed":
        assert "the survivors committed step 6, whose answer was lost" in caplog.text
        assert (out / "checkpoints" / "step-00000006").is_dir()


def test_newcomers_end_a_window_early_and_join(unchanged, ray_cluster, corpus_dir,
                                               cache_root, tmp_path, caplog):
    """3 ranks of 1 CPU on 4: rank 1 dies before step 4, the two survivors carry on;
    rank 0 stalls in steps 7-11 so that the new rank the free CPU allows warms up while
    the ranks run steps 7-12 on their own. The driver asks rank 0 to stop: every rank
    ends the window at the same step, the newcomer joins, and the losses and samples
    are the unchanged run's."""
    caplog.set_level(logging.DEBUG, logger="raylm")
    stalls = [{"rank": 0, "step": s, "phase": "step", "action": "stall", "seconds": 2.5,
               "generation": 2} for s in range(6, 11)]
    out = tmp_path / "out"
    with inject({"rank": 1, "step": 3, "phase": "step"}, *stalls):
        result = train(elastic_config(out, corpus_dir, cache_root, cpus_per_worker=1,
                                      step_protocol="ranks"))
    assert "shrank in memory to 2 rank(s)" in caplog.text
    assert "grew in memory to 3 rank(s)" in caplog.text
    windows = [int(r.getMessage().split()[4].split("-")[0]) for r in caplog.records
               if r.getMessage().startswith("the ranks run steps")]
    assert windows[:3] == [1, 4, 7] and 8 <= windows[3] <= 12, windows
    sizes = [h["world_size"] for h in result.history]
    assert sizes[:3] == [3, 3, 3] and 2 in sizes and sizes[-1] == 3, sizes
    np.testing.assert_allclose([h["loss"] for h in result.history],
                               [unchanged["losses"][s] for s in range(1, STEPS + 1)],
                               rtol=1e-5)
    assert samples_per_step(out) == unchanged["samples"]
