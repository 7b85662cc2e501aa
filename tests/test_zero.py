"""ZeRO stages 1-3 on the real Ray runtime: loss parity, per-rank state against the ZeRO
paper's formulas, checkpoints that move between stages and data-parallel sizes.

Every run reproduces single-process training (fp32 per-step losses within 1e-5 relative
of a plain PyTorch loop on the same samples) and saves one ordinary Hugging Face model
with the reference's weights. The state each rank holds is measured from its tensors
(raylm.runtime.memory.state_bytes: local shards, each storage once) on the first step.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from raylm import train
from raylm.plan.zero import theory_bytes
from tests.conftest import CPUS
from tests.reference import reference_fixture
from tests.test_pipeline import GLOBAL_BATCH, STEPS, assert_parity, assert_recomputed
from tests.test_tensor_layouts import tp_config

# Single-process losses and final weights (the tensor-layout tests' models: GPT-2 with a
# tied 4099-row embedding, a third of the model, which no split by whole tensors could
# share out within 5%).
reference = reference_fixture("tensor", tp_config, GLOBAL_BATCH, STEPS)


def zero_config(out, corpus, cache_root, model="gpt2", **kw):
    return tp_config(out, corpus, cache_root, model, **kw)


# In order of world size: each run takes the last one's rank processes when it has as
# many (conftest's kept_ranks).
RUNS = [  # (stage, dp, pp, tp, activation checkpointing)
    (1, 2, 1, 1, "none"), (2, 2, 1, 1, "selective"), (3, 2, 1, 1, "none"),
    (1, 4, 1, 1, "none"), (2, 4, 1, 1, "none"), (3, 4, 1, 1, "full"),
    # with a pipeline, with tensor parallelism (4 rank actors each)
    (2, 2, 2, 1, "none"), (3, 2, 2, 1, "selective"),
    (1, 2, 1, 2, "none"), (3, 2, 1, 2, "full"),
]
# ZeRO-3 keeps its parameters gathered through each step by default where they fit, as
# they do here, except under a pipeline: one run frees them after each forward instead,
# with 2 micro-batches a step (each reduce-scatters its gradients; on gloo the first in
# the background, the second adding into what the first wrote: raylm's GlooReduceScatter).
RESHARDED = {(3, 2, 1, 1, "none")}


# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_zero_matches_single_process": {"stage1-dp2", "stage2-dp2-selective", "stage3-dp2",
        "stage2-dp2-pp2"},
}


@pytest.mark.parametrize("stage,dp,pp,tp,recompute", RUNS,
                         ids=[f"stage{s}-dp{d}" + (f"-pp{p}" if p > 1 else "") +
                              (f"-tp{t}" if t > 1 else "") + ("" if r == "none" else f"-{r}")
                              for s, d, p, t, r in RUNS])
def test_zero_matches_single_process(stage, dp, pp, tp, recompute, reference, ray_cluster,
                                     corpus_dir, cache_root, tmp_path):
    resharded = (stage, dp, pp, tp, recompute) in RESHARDED
    cfg = zero_config(tmp_path / "out", corpus_dir, cache_root, dp=dp, pp=pp, tp=tp,
                      num_workers=dp * pp * tp, zero_stage=stage,
                      cpus_per_worker=CPUS,
                      activation_checkpointing=recompute,
                      reshard_after_forward=True if resharded else None)
    result = train(cfg)
    assert result.metrics["world_size"] == dp * pp * tp
    assert_parity(result, reference("gpt2"))
    assert_zero_memory(result.output_dir, stage, dp, pp * tp)
    assert_recomputed(result.output_dir, recompute)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        kept = not json.load(f)["layout"]["reshard_after_forward"]
    assert kept == (stage == 3 and pp == 1 and not resharded)


def test_zero3_parameters_kept_gathered_through_the_step(reference, ray_cluster, corpus_dir,
                                                        cache_root, tmp_path):
    """ZeRO-3 (dp=2, 2 micro-batches a step, an evaluation between steps) with
    --reshard_after_forward left unset, which where the parameters fit is False: the
    blocks keep their gathered parameters from the step's first forward to its last
    backward (one all-gather a step instead of two per micro-batch;
    benchmarks/bench_zero.py measures the speed). The same single-process losses,
    gradient norms and final weights; between steps the states are sharded as at
    ZeRO-3, to the byte of the ZeRO figures."""
    cfg = zero_config(tmp_path / "out", corpus_dir, cache_root, dp=2, num_workers=2,
                      zero_stage=3, cpus_per_worker=CPUS,
                      do_train=True, do_eval=True, eval_strategy="steps", eval_steps=1,
                      max_eval_samples=8)
    result = train(cfg)
    assert_parity(result, reference("gpt2"))
    assert_zero_memory(result.output_dir, 3, 2, 1)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        assert json.load(f)["layout"]["reshard_after_forward"] is False
    # (an evaluation after every step: forwards with no backward, which leave the
    # parameters gathered until the engine frees them)
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        evals = [r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r]
    assert len(evals) >= 3 and all(np.isfinite(evals))


def assert_zero_memory(output_dir, stage, dp, group):
    """Each rank's parameters, gradients and optimizer states, measured from the tensors
    it holds, are the ZeRO paper's figures for its replica's Psi within 5%; the dp ranks
    of a replica position own disjoint shares that add up to the whole."""
    with open(os.path.join(output_dir, "memory.json")) as f:
        report = json.load(f)
    assert report["layout"]["zero_stage"] == stage
    assert len(report["ranks"]) == dp * group
    for r in report["ranks"]:
        theory = theory_bytes(r["replica_elements"], stage, dp)
        for kind in ("parameters", "gradients", "optimizer"):
            measured = r["measured"][kind]
            assert abs(measured - theory[kind]) <= 0.05 * theory[kind], \
                (kind, r["coords"], measured, theory[kind])
    # Partitioned states really are partitions: over the dp ranks of one (pp, tp)
    # position the optimizer states add up to one replica's (8 bytes a parameter).
    by_position: dict = {}
    for r in report["ranks"]:
        key = (r["coords"]["pp"], r["coords"]["tp"])
        by_position.setdefault(key, []).append(r)
    for ranks in by_position.values():
        assert len(ranks) == dp
        total = sum(r["measured"]["optimizer"] for r in ranks)
        np.testing.assert_allclose(total, 8 * ranks[0]["replica_elements"], rtol=0.01)


@pytest.mark.slow
def test_checkpoint_moves_between_stages(reference, ray_cluster, corpus_dir, cache_root,
                                         tmp_path):
    """A checkpoint written under ZeRO-3 with dp=4 resumes under ZeRO-1 with dp=2 (and
    under stage 0 on one worker) with the reference's following losses: the partitions
    are DTensor shards that torch.distributed.checkpoint reshards."""
    ref_losses = reference("gpt2").losses
    first = train(zero_config(tmp_path / "src", corpus_dir, cache_root, dp=4, num_workers=4,
                              zero_stage=3, save_steps=1))
    ckpt = os.path.join(first.output_dir, "checkpoints", "step-00000001")
    assert os.path.isdir(ckpt)
    for name, layout in (("stage1-dp2", dict(dp=2, num_workers=2, zero_stage=1)),
                         ("stage0-single", dict(num_workers=1, zero_stage=0))):
        resumed = train(zero_config(tmp_path / name, corpus_dir, cache_root,
                                    resume_from_checkpoint=ckpt, **layout))
        steps = [h["step"] for h in resumed.history]
        assert steps == list(range(2, STEPS + 1)), (name, steps)
        np.testing.assert_allclose([h["loss"] for h in resumed.history], ref_losses[1:],
                                   rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_zero3_tensor_parallel_checkpoint_resumes_without_it(reference, ray_cluster,
                                                            corpus_dir, cache_root, tmp_path):
    """ZeRO-3 over tensor-parallel shards (each rank its dp rows of its tp shard of a
    padded vocabulary and fused GPT-2 layers) checkpoints in the model's own shapes: it
    resumes under ZeRO-2 with dp=2 and no tensor parallelism, with the reference's losses."""
    ref_losses = reference("gpt2").losses
    first = train(zero_config(tmp_path / "src", corpus_dir, cache_root, dp=2, tp=2,
                              num_workers=4, zero_stage=3, save_steps=1))
    ckpt = os.path.join(first.output_dir, "checkpoints", "step-00000001")
    resumed = train(zero_config(tmp_path / "dst", corpus_dir, cache_root, dp=2, num_workers=2,
                                zero_stage=2, resume_from_checkpoint=ckpt))
    assert [h["step"] for h in resumed.history] == list(range(2, STEPS + 1))
    np.testing.assert_allclose([h["loss"] for h in resumed.history], ref_losses[1:], rtol=1e-5)


NEOX = "num_hidden_layers=4,hidden_size=32,num_attention_heads=2,intermediate_size=64"


@pytest.mark.parametrize("kw,message", [
    (dict(pipeline_schedule="zero_bubble"), "--zero_stage 3 with --pipeline_schedule zero_bubble"),
    (dict(model_type="gpt_neox", config_overrides=NEOX),
     "cut by the generic torch.export split"),
], ids=["zero-bubble", "generic-split"])
def test_zero3_pipelines_not_supported_yet_are_one_clear_error(kw, message, ray_cluster,
                                                               corpus_dir, cache_root,
                                                               tmp_path):
    from tests.test_bad_input import assert_fails_before_any_actor

    assert_fails_before_any_actor(message, tmp_path, corpus_dir, cache_root, dp=2, pp=2,
                                  num_workers=4, zero_stage=3,
                                  gradient_accumulation_steps=2, **kw)
