"""Mixed precision on the real Ray runtime: --bf16 and --fp16 in every kind of layout
against a single-process run with the same precision settings (tests/reference.py: the
forward under torch.autocast, fp32 master weights; fp16 with torch's GradScaler).

The tolerance. bf16 keeps 8 bits of mantissa: each rounding is off by up to 2^-9 = 2e-3
relative. A layout computes the same sums in another order (another micro-batch
composition, a tensor-parallel split of a matrix multiply, a pipeline's stages), so its
fp32 accumulations differ in the last fp32 bits, and where one lands on the other side
of a bf16 rounding boundary the element differs by a whole bf16 step. Those differences
are sparse and of either sign: the loss, a mean over every token, moves by far less than
one step. Measured here over the 3 steps: losses within 8e-6 relative of the reference's
(tp=2 the most; dp and pp 4e-8), gradient norms, sums of squares where the sparse
full-step differences add up rather than average, within 1.1e-3 (ZeRO-3, whose FSDP2
all-gathers bf16 parameters). The tolerances leave a margin for another CPU's order of
accumulation: ``LOSS_REL`` 1e-3, half a bf16 step, and ``NORM_REL`` 1e-2, while a real
error (a gradient summed twice, a loss scaled twice) moves
the steps after the first by far more: they train at a learning rate of 1e-3 on a model
whose loss falls by ~0.1 per step.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.torch import load_file

from raylm import train
from raylm.checkpoint.manager import CheckpointManager, read_trainer_state
from raylm.runtime.faults import inject
from tests.conftest import CPUS
from tests.reference import reference_fixture
from tests.test_pipeline import GLOBAL_BATCH, STEPS
from tests.test_tensor_layouts import tp_config

LOSS_REL = 1e-3
NORM_REL = 1e-2


def bf16_config(out, corpus, cache_root, model="gpt2", **kw):
    return tp_config(out, corpus, cache_root, model, bf16=True, **kw)


reference = reference_fixture("bf16", bf16_config, GLOBAL_BATCH, STEPS)


def assert_close_to(result, ref, label, steps=STEPS):
    """Per-step losses within LOSS_REL and gradient norms within NORM_REL of the
    reference's; a step whose fp16 gradients overflowed (a norm not finite) overflowed
    in both."""
    hist = result.history
    assert [h["step"] for h in hist] == list(range(1, steps + 1)), label
    losses = np.array([h["loss"] for h in hist])
    norms, ref_norms = np.array([h["grad_norm"] for h in hist]), np.array(ref.grad_norms)
    print(f"{label}: losses off by {np.max(np.abs(losses / ref.losses - 1)):.2e} relative "
          f"at most; finite gradient norms by "
          f"{np.nanmax(np.abs(norms / ref_norms - 1)[np.isfinite(ref_norms)]):.2e}")
    np.testing.assert_allclose(losses, ref.losses, rtol=LOSS_REL, atol=0,
                               err_msg=f"{label}: losses")
    assert list(np.isfinite(norms)) == list(np.isfinite(ref_norms)), (label, norms, ref_norms)
    finite = np.isfinite(ref_norms)
    np.testing.assert_allclose(norms[finite], ref_norms[finite], rtol=NORM_REL, atol=0,
                               err_msg=f"{label}: gradient norms")
    assert hist[-1]["loss"] < hist[0]["loss"]  # it trained


RUNS = [  # (dp, pp, tp, zero stage)
    (2, 1, 1, 0), (1, 1, 2, 0), (1, 2, 1, 0), (2, 1, 1, 2), (2, 1, 1, 3),
]


# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_bf16_layout_matches_single_process_bf16": {"dp2-pp1-tp1-zero3", "dp1-pp2-tp1"},
}


@pytest.mark.slow
def test_50_bf16_steps_train_as_fp32_does(ray_cluster, corpus_dir, cache_root, tmp_path):
    """bf16 changes the arithmetic, not the training: after 50 steps raylm's bf16 run's
    loss is within 2% of single-process fp32's on the same samples (the tiny GPT-2 of
    the parity tests, 1 rank: the precision alone)."""
    from tests.reference import reference_run
    from raylm.runtime.input_checks import check_inputs
    from raylm.runtime.prepare import prepare_data
    from tests.test_parity import tiny_config

    steps = 50
    fp32 = tiny_config(tmp_path / "fp32", corpus_dir, cache_root, max_steps=steps,
                       gradient_accumulation_steps=2, per_device_train_batch_size=4)
    inputs = check_inputs(fp32)
    data = prepare_data(fp32, inputs)
    ref_losses = reference_run(fp32, inputs.spec, data.train, data.train_ids, 8, steps)[0]
    bf16 = tiny_config(tmp_path / "bf16", corpus_dir, cache_root, max_steps=steps,
                       gradient_accumulation_steps=2, per_device_train_batch_size=4,
                       num_workers=1, bf16=True)
    losses = [h["loss"] for h in train(bf16).history]
    print(f"50 steps: fp32 {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}, bf16 "
          f"{losses[0]:.4f} -> {losses[-1]:.4f} ({losses[-1] / ref_losses[-1] - 1:+.2%})")
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it learned something (8.32 -> 7.55)
    assert abs(losses[-1] / ref_losses[-1] - 1) < 0.02


@pytest.mark.parametrize("dp,pp,tp,stage", RUNS,
                         ids=[f"dp{d}-pp{p}-tp{t}" + (f"-zero{z}" if z else "")
                              for d, p, t, z in RUNS])
def test_bf16_layout_matches_single_process_bf16(dp, pp, tp, stage, reference, ray_cluster,
                                                 corpus_dir, cache_root, tmp_path):
    # One run saves its model in bf16 (--torch_dtype); the others in the masters' fp32.
    saved_as = "bfloat16" if (dp, stage) == (2, 0) else None
    cfg = bf16_config(tmp_path / "out", corpus_dir, cache_root, dp=dp, pp=pp, tp=tp,
                      num_workers=dp * pp * tp, zero_stage=stage, torch_dtype=saved_as,
                      cpus_per_worker=CPUS)
    result = train(cfg)
    assert_close_to(result, reference("gpt2"), f"bf16 dp={dp} pp={pp} tp={tp} ZeRO-{stage}")
    assert_bf16_memory_predicted(result.output_dir, stage)
    saved = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert {str(v.dtype) for v in saved.values()} == {f"torch.{saved_as or 'float32'}"}
    with open(os.path.join(result.output_dir, "config.json")) as f:
        assert json.load(f)["dtype"] == (saved_as or "float32")
    if saved_as:  # the bf16 file holds the trained masters, rounded to bf16 (2^-8 rel.)
        ref = reference("gpt2").state
        # AdamW moves an element by at most A_t times the learning rate at step t,
        # whatever its gradient (tests/numerics.py): two runs differ by at most twice that.
        from tests.numerics import adam_ceiling

        bound = sum(2 * adam_ceiling(cfg.adam_beta1, cfg.adam_beta2, t)
                    for t in range(1, STEPS + 1)) * cfg.learning_rate
        for name, w in saved.items():
            np.testing.assert_allclose(w.float().numpy(), ref[name].numpy(), rtol=2.0 ** -8,
                                       atol=bound, err_msg=name)


def assert_bf16_memory_predicted(output_dir, stage):
    """memory.json under bf16: each rank's activations kept for backward and autocast's
    weight copies (none under ZeRO-3: FSDP2 gathers bf16 parameters), as the rank
    measured them, within 15% of the planner's prediction."""
    with open(os.path.join(output_dir, "memory.json")) as f:
        report = json.load(f)
    assert report["precision"] == "bf16"
    for r in report["ranks"]:
        m, p = r["measured"], r["predicted"]
        assert abs(p["activations"] / m["activations"] - 1) < 0.15, r
        if stage == 3:
            assert m["weight_copies"] == p["weight_copies"] == 0, r
        else:
            assert abs(p["weight_copies"] / m["weight_copies"] - 1) < 0.15, r


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(ray_cluster, corpus_dir,
                                                                 cache_root, tmp_path):
    """dp=2 x pp=2 in fp16: at step 2 one rank's gradients overflow (injected: its first
    gradient becomes inf, the other three ranks' stay finite). All four ranks skip that
    step (they agree through the global gradient norm; the driver refuses a
    disagreement), the scale halves, and it doubles after each good step
    (--loss_scale_window 1): the run computes what torch's GradScaler does in one
    process with the same overflow."""
    from raylm.runtime.input_checks import check_inputs
    from raylm.runtime.prepare import prepare_data
    from tests.reference import Reference, reference_run

    cfg = tp_config(tmp_path / "out", corpus_dir, cache_root, "gpt2", fp16=True,
                    loss_scale_window=1, dp=2, pp=2, num_workers=4,
                    save_steps=2)
    inputs = check_inputs(cfg)
    data = prepare_data(cfg, inputs)
    losses, norms, state, _ = reference_run(cfg, inputs.spec, data.train, data.train_ids,
                                            GLOBAL_BATCH, STEPS, overflow_steps=(1,))
    with inject({"rank": 3, "step": 1, "phase": "overflow"}):
        result = train(cfg)
    hist = result.history
    assert [h["skipped"] for h in hist] == [False, True, False]
    scale = cfg.initial_loss_scale
    assert [h["loss_scale"] for h in hist] == [scale, 2 * scale, scale]
    assert hist[-1]["loss_scale_after"] == {"scale": 2 * scale, "good": 0}
    # Step 2 went out as soon as step 1 answered, its scale from step 1's state after (no
    # checkpoint or evaluation was due between them); step 3 waited for step 2's save.
    assert result.metrics["steps_sent_ahead"] == 1
    # A checkpoint keeps the scale after its step (a restore or resume goes on from it).
    state = read_trainer_state(CheckpointManager(cfg.output_dir).path_for(2))
    assert state["loss_scale"] == {"scale": scale, "good": 0}
    assert_close_to(result, Reference(losses, norms, state, None, None), "fp16 dp=2 x pp=2")
