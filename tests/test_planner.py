"""The layout planner and its cost model: predictions against what real runs hold, the
choices it makes, and planning a 70B model on 1024 workers in seconds.

Memory is checked against measurements of real training (raylm.runtime.memory): one rank
in this process, and both ranks of a 2-stage 1F1B pipeline in two torch.distributed gloo
processes, for a GPT-2 (dropout on: SDPA's math path keeps the attention scores) and a
Llama (grouped-query attention, fused SDPA, gated MLP), also with heads x head_dim wider
than its hidden size. No Ray.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch

from raylm.cli.main import main
from raylm.config import TrainConfig
from raylm.errors import ConfigError
from raylm.plan.cost import Layout, rank_memory, single_stage, step_time
from raylm.plan.dims import ParallelDims
from raylm.plan.hardware import GIB, hardware_for
from raylm.plan.layout import make_plan
from raylm.plan.partition import partition
from raylm.plan.planner import evaluate_layout, search_for_config
from raylm.plan.shape import model_shape
from raylm.plan.text import human_bytes
from raylm.runtime.memory import ActivationMeter, state_bytes
from tests.gloo_ranks import run_ranks

SEQ, BATCH, VOCAB = 64, 4, 500
MODELS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, n_positions=SEQ,
                 vocab_size=VOCAB),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                  max_position_embeddings=SEQ, vocab_size=VOCAB),
    # Queries and attention output 8x wider than the hidden size (heads x head_dim =
    # 512), as any Llama config whose hidden size --config_overrides makes smaller has
    # them (the default head_dim of 128 stays, as in run_clm); Qwen3 and Gemma set
    # head_dim apart too
    "llama-wide": dict(model_type="llama", num_hidden_layers=2, hidden_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                       intermediate_size=176, max_position_embeddings=SEQ, vocab_size=VOCAB),
}
# Checked in one process only (not cut into stages or split over tp here): Qwen3, whose
# per-head RMSNorms of the queries and keys keep tensors of their own
ONE_PROCESS = {
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, hidden_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=176, max_position_embeddings=SEQ, vocab_size=VOCAB),
}
TOLERANCE = 0.15
LLAMA_70B = ("hidden_size=8192,num_hidden_layers=80,num_attention_heads=64,"
             "num_key_value_heads=8,intermediate_size=28672,vocab_size=128256,"
             "max_position_embeddings=4096")
TINY_GPT2 = "n_layer=4,n_embd=32,n_head=4,n_positions=64"
TINY_LLAMA = ("num_hidden_layers=4,hidden_size=32,num_attention_heads=4,"
              "num_key_value_heads=2,intermediate_size=64,max_position_embeddings=64")


def _config(name):
    from transformers import AutoConfig

    kw = dict(MODELS.get(name) or ONE_PROCESS[name])
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _model(name, device=None):
    from transformers import AutoModelForCausalLM

    if device == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(_config(name))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name))
    model.config.use_cache = False
    return model.train()


def _optimizer(model):
    # As the worker builds it: AdamW, matrices decayed, biases and norms not.
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2],
                               "weight_decay": 0.01},
                              {"params": [p for p in params if p.ndim < 2],
                               "weight_decay": 0.0}], lr=1e-3)


def _loss(logits, labels):
    from raylm.models.objectives import CausalLM

    return CausalLM().loss_sum(logits, labels)


def _predicted(name, part_bounds=None, microbatches=2, recompute="none", bf16=False):
    """Per pp rank, the cost model's Memory for the layout (dp=1, tp=1)."""
    shape = model_shape(_model(name, "meta"), SEQ)
    hw = hardware_for(TrainConfig(bf16=bf16))  # CPU: float dropout masks
    if part_bounds is None:
        part, pp = single_stage(shape), 1
    else:
        pp = len(part_bounds)
        part = partition(shape.embed, list(shape.blocks), shape.head, pp, "1f1b", 1,
                         [b[0] for b in part_bounds[1:]])
    layout = Layout(dims=ParallelDims(pp=pp), micro_batch_size=BATCH,
                    microbatches=microbatches, recompute=recompute)
    return rank_memory(shape, part, layout, hw)


def _compare(measured: dict, predicted) -> dict:
    """Relative errors of the prediction, per part and for the whole rank."""
    parts = ("parameters", "gradients", "optimizer", "activations")
    err = {k: getattr(predicted, k) / measured[k] - 1 for k in parts}
    total_m = sum(measured[k] for k in parts)
    err["total"] = (predicted.states + predicted.activations) / total_m - 1
    return err


def _assert_close(err: dict, where: str, tolerance: float = TOLERANCE):
    for k in ("parameters", "gradients", "optimizer"):
        assert abs(err[k]) < 0.01, (where, k, err)
    assert abs(err["activations"]) < tolerance, (where, err)
    assert abs(err["total"]) < tolerance, (where, err)


# Models whose attention terms the tests pin: the prediction is exact to a few bytes, and
# a term counted wrong moves it by 6% or more (measured: Qwen3's bf16 q/k norms kept in
# fp32), which 15% would not see
EXACT = ("llama-wide", "qwen3")


def _tolerance(name: str) -> float:
    return 0.02 if name in EXACT else TOLERANCE


# -- memory: prediction vs measurement --------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-wide", "qwen3"])
def test_single_rank_memory_matches_a_measured_run(name):
    model = _model(name)
    opt = _optimizer(model)
    g = torch.Generator().manual_seed(0)
    with ActivationMeter(model) as meter:
        for _ in range(2):  # gradient accumulation: micro-batches one after the other
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            _loss(model(input_ids=ids).logits, ids).backward()
            assert meter.live == 0  # backward released every saved tensor
    opt.step()
    measured = {**state_bytes(model, opt), "activations": meter.peak}
    err = _compare(measured, _predicted(name)[0])
    print(name, {k: f"{v:+.2%}" for k, v in err.items()})
    _assert_close(err, name, _tolerance(name))


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3"])
def test_bf16_memory_matches_a_measured_run(name):
    """Under torch.autocast(bf16) with fp32 master weights: the states are fp32's, the
    activations kept for backward (fp32 norms and residual stream, bf16 matmul inputs
    and outputs) and autocast's bf16 copies of the matrices (one per step, shared by
    the micro-batches) each within 15% of the prediction, and fewer activation bytes
    than fp32 keeps. GPT-2 here has dropout (CPU's math attention path, which upcasts to
    fp32), Llama the fused kernel."""
    model = _model(name)
    opt = _optimizer(model)
    g = torch.Generator().manual_seed(0)
    with ActivationMeter(model) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            _loss(model(input_ids=ids).logits, ids).backward()
            assert meter.live == 0
    opt.step()
    measured = {**state_bytes(model, opt), "activations": meter.peak}
    predicted = _predicted(name, bf16=True)[0]
    err = _compare(measured, predicted)
    err["weight_copies"] = predicted.weight_copies / meter.copies_peak - 1
    print(name, "bf16", {k: f"{v:+.2%}" for k, v in err.items()})
    _assert_close(err, f"{name} bf16", _tolerance(name))
    assert abs(err["weight_copies"]) < TOLERANCE, err
    fp32 = _predicted(name)[0]
    assert predicted.activations < 0.9 * fp32.activations and fp32.weight_copies == 0


@pytest.mark.parametrize("name,bf16", [("gpt2", False), ("llama", False), ("llama", True),
                                       ("llama-wide", False)],
                         ids=["gpt2", "llama", "llama-bf16", "llama-wide"])
def test_recomputation_keeps_what_is_predicted_and_the_same_gradients(name, bf16):
    """Activation checkpointing, each mode on the same model, data and dropout draws:
    the same loss and gradients as keeping everything (fp32: the recomputed forward is
    the same arithmetic), and the activations kept for backward, measured, drop to the
    prediction's within 15% (GPT-2 here has dropout: the math attention path, whose
    score matrices selective checkpointing recomputes). Under bf16 autocast too (the
    recomputation replays the forward's autocast: the same arithmetic again)."""
    from raylm.parallel.recompute import apply_activation_checkpointing

    runs = {}
    for mode in ("none", "selective", "full"):
        model = _model(name)
        assert apply_activation_checkpointing(model, mode) == (0 if mode == "none" else 2)
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(1)  # the dropout draws
        with ActivationMeter(model) as meter, torch.autocast("cpu", torch.bfloat16,
                                                             enabled=bf16):
            losses = []
            for _ in range(2):
                ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
                loss = _loss(model(input_ids=ids).logits, ids)
                loss.backward()
                losses.append(loss.item())
                assert meter.live == 0
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        predicted = _predicted(name, recompute=mode, bf16=bf16)[0]
        runs[mode] = (losses, grads, meter.peak, predicted)
        err = predicted.activations / meter.peak - 1
        print(name, mode, bf16, f"kept {meter.peak:,} B, predicted {predicted.activations:,.0f} "
              f"({err:+.2%}); recomputation workspace {predicted.workspace:,.0f} B")
        assert abs(err) < TOLERANCE, (name, mode, err)
    base_losses, base_grads = runs["none"][:2]
    for mode in ("selective", "full"):
        losses, grads, kept, predicted = runs[mode]
        assert losses == pytest.approx(base_losses, rel=1e-6, abs=0)
        torch.testing.assert_close(grads, base_grads, rtol=1e-5, atol=1e-7)
        # what it saves, measured and predicted, and the recomputation's transient
        assert kept < runs["none"][2] and predicted.activations < runs["none"][3].activations
        assert predicted.workspace > runs["none"][3].workspace
    assert runs["full"][2] < runs["selective"][2]


def _pipeline_rank(rank: int, port: int, queue) -> None:
    """One rank of a 2-stage 1F1B pipeline (4 micro-batches, 2 steps) per test model:
    its measured state and peak activations."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from raylm.parallel.pipeline.stages import cut
    from raylm.plan.partition import Partition

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    out = {}
    try:
        for name in MODELS:
            model = _model(name)
            part = Partition(bounds=[(0, 1), (1, 2)], stage_rank=[0, 1])
            mods, _, _ = cut(model, part, [rank], torch.zeros(BATCH, SEQ, dtype=torch.long))
            stage = PipelineStage(mods[0], rank, 2, torch.device("cpu"))
            schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=_loss,
                                    scale_grads=False)
            opt = _optimizer(model)
            ids = torch.randint(0, VOCAB, (4 * BATCH, SEQ),
                                generator=torch.Generator().manual_seed(0))
            with ActivationMeter(model) as meter:
                for _ in range(2):
                    if rank == 0:
                        schedule.step(ids)
                    else:
                        schedule.step(target=ids, losses=[])
            opt.step()
            out[name] = {**state_bytes(model, opt), "activations": meter.peak}
    finally:
        dist.destroy_process_group()
    queue.put((rank, out))


def test_pipeline_ranks_memory_matches_measured_runs():
    """pp=2, 1F1B, 4 micro-batches in two gloo processes: stage 0 (embeddings + block 0)
    holds 2 micro-batches at its peak, stage 1 (block 1 + head) holds 1; GPT-2's tied
    table is on both ranks."""
    results, procs = run_ranks(_pipeline_rank, 2)
    assert [p.exitcode for p in procs] == [0, 0]
    for name in MODELS:
        predicted = _predicted(name, part_bounds=[(0, 1), (1, 2)], microbatches=4)
        assert [m.in_flight for m in predicted] == [2, 1]
        for rank in range(2):
            err = _compare(results[rank][name], predicted[rank])
            print(name, "pp rank", rank, {k: f"{v:+.2%}" for k, v in err.items()})
            _assert_close(err, f"{name} pp rank {rank}")


def test_activation_meter_counts_storages_once_and_sees_releases():
    model = _model("gpt2")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with ActivationMeter(model) as meter:
        loss = _loss(model(input_ids=ids).logits, ids)
        forward = meter.live
        assert forward > 0 and meter.peak == forward
        del loss  # a graph dropped without backward frees its saved tensors too
        assert meter.live == 0
        x = torch.randn(1000, requires_grad=True)
        y = x.exp()  # saves its output
        (y * y).sum()  # y saved twice: one storage
        assert meter.live == 4000
    assert meter.peak == forward
    # parameters are state, not activations: a bare matmul with a weight saves the input
    # only
    with ActivationMeter(model) as meter:
        h = torch.randn(8, 64)
        out = model.transformer.h[0].mlp.c_fc(h)
        assert meter.live == h.numel() * 4
        del out


def test_state_bytes_counts_a_tied_table_once():
    model = _model("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    n = sum(p.numel() for p in model.parameters())
    assert state_bytes(model) == {"parameters": 4 * n, "gradients": 0, "optimizer": 0}


def test_attention_free_blocks_count_no_attention_flops():
    """A block's forward FLOPs per token are its matrices' plus, where it attends, 4 x
    seq x heads x head_dim for the scores and their weighted sum: none in a Mamba
    block (whose config has heads, Mamba2's, but no attention), and half the layers'
    worth in a hybrid raylm cannot cut (Jamba, attention every other layer here)."""
    from transformers import AutoModelForCausalLM, GPT2Config, JambaConfig, Mamba2Config

    from raylm.models.units import distinct_params, matmul_flops

    def built(config):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return model, model_shape(model, SEQ)

    def matmuls(model, unit):
        return matmul_flops(distinct_params([model.get_submodule(unit.name)]).values())

    mamba, shape = built(Mamba2Config(hidden_size=64, num_hidden_layers=2, vocab_size=101,
                                      num_heads=4, head_dim=32, n_groups=1, state_size=8))
    assert all(u.flops == matmuls(mamba, u) for u in shape.blocks)
    gpt2, shape = built(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101))
    assert all(u.flops == matmuls(gpt2, u) + 4 * SEQ * 64 for u in shape.blocks)
    jamba, shape = built(JambaConfig(hidden_size=64, num_hidden_layers=4, vocab_size=101,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, attn_layer_period=2,
                                     attn_layer_offset=1, expert_layer_period=100,
                                     num_experts=1, mamba_d_state=8))
    per = shape.blocks[0].params  # (one unit per layer: raylm cannot cut it)
    assert all(u.flops == 2 * per + 4 * SEQ * 64 * 0.5 for u in shape.blocks)


# -- the cost model's formulas -----------------------------------------------------------
def test_zero_stages_shard_states_over_dp():
    shape = model_shape(_model("llama", "meta"), SEQ)
    hw = hardware_for(TrainConfig())
    part = single_stage(shape)
    psi = shape.total_params

    def mem(zero):
        layout = Layout(dims=ParallelDims(dp=4), micro_batch_size=BATCH, microbatches=1,
                        zero_stage=zero)
        return rank_memory(shape, part, layout, hw)[0]

    m0, m1, m2, m3 = (mem(z) for z in range(4))
    assert (m0.parameters, m0.gradients, m0.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    assert (m1.parameters, m1.gradients, m1.optimizer) == (4 * psi, 4 * psi, 2 * psi)
    assert (m2.parameters, m2.gradients, m2.optimizer) == (4 * psi, psi, 2 * psi)
    assert (m3.parameters, m3.gradients, m3.optimizer) == (psi, psi, 2 * psi)
    assert m3.workspace > m0.workspace  # gathered blocks
    assert m0.activations == m3.activations
    # --reshard_after_forward False: every parameter gathered through the step (4 bytes
    # each) in place of two blocks; the states stay sharded.
    kept = rank_memory(shape, part, Layout(dims=ParallelDims(dp=4), micro_batch_size=BATCH,
                                           microbatches=1, zero_stage=3,
                                           reshard_after_forward=False), hw)[0]
    biggest = max(u.params for u in shape.blocks)
    assert (kept.parameters, kept.gradients, kept.optimizer) == (psi, psi, 2 * psi)
    assert kept.workspace - m3.workspace == 4 * psi - 2 * 4 * biggest
    # With more than one micro-batch a step their gradients accumulate unsharded too (4
    # bytes each, in place of one block's), reduce-scattered once at the last backward.
    def four(**kw):
        return rank_memory(shape, part, Layout(dims=ParallelDims(dp=4), micro_batch_size=BATCH,
                                               microbatches=4, zero_stage=3, **kw), hw)[0]
    kept4, m34 = four(reshard_after_forward=False), four()
    assert kept4.workspace - m34.workspace == pytest.approx(8 * psi - 3 * 4 * biggest)


def test_tensor_parallel_shards_matrices_and_activations():
    shape = model_shape(_model("llama", "meta"), SEQ)
    hw = hardware_for(TrainConfig())
    part = single_stage(shape)
    one, two = (rank_memory(shape, part, Layout(dims=ParallelDims(tp=t), micro_batch_size=BATCH,
                                                microbatches=1), hw)[0] for t in (1, 2))
    norms = 2 * 64 * 2 + 64  # two RMSNorm weights per block, the final norm: replicated
    assert two.param_count == pytest.approx((shape.total_params - norms) / 2 + norms)
    assert one.activations / 2 < two.activations < one.activations  # norms replicated


def test_step_time_bubble_and_communication():
    shape = model_shape(_model("gpt2", "meta"), SEQ)
    hw = hardware_for(TrainConfig(worker_tflops=1.0))

    def timed(pp, schedule="1f1b", m=8, tp=1, dp=1):
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        part = (partition(shape.embed, list(shape.blocks), shape.head, pp, schedule, virtual)
                if pp > 1 else single_stage(shape))
        layout = Layout(dims=ParallelDims(dp=dp, pp=pp, tp=tp), micro_batch_size=BATCH,
                        microbatches=m, schedule=schedule, virtual=virtual)
        return step_time(shape, part, layout, hw, rank_memory(shape, part, layout, hw))

    one, piped = timed(1), timed(2)
    assert one.bubble == one.tp_comm == one.pp_comm == one.dp_comm == 0
    assert piped.bubble_fraction == pytest.approx(1 / (8 + 1))  # (pp-1)/(m+pp-1)
    assert timed(2, "gpipe").step == pytest.approx(piped.step)
    assert timed(2, "gpipe", m=2).bubble_fraction > piped.bubble_fraction
    assert timed(1, tp=2).tp_comm > 0 and timed(1, dp=2).dp_comm > 0


# -- the planner's choices ---------------------------------------------------------------
def _cfg(model_type="gpt2", overrides=TINY_GPT2, **kw) -> TrainConfig:
    kw.setdefault("block_size", 32)
    return TrainConfig(model_type=model_type, config_overrides=overrides, **kw)


@pytest.mark.parametrize("model_type, overrides", [("gpt2", TINY_GPT2),
                                                   ("llama", TINY_LLAMA)])
def test_tiny_models_on_a_few_workers_stay_data_parallel(model_type, overrides):
    for workers in (1, 2, 4):
        for mbs, gas in ((1, 1), (8, 2)):
            cfg = _cfg(model_type, overrides, per_device_train_batch_size=mbs,
                       gradient_accumulation_steps=gas)
            plan = make_plan(cfg, workers)
            assert (plan.dp, plan.tp, plan.pp) == (workers, 1, 1), (workers, mbs, gas)
            assert plan.global_batch_size == mbs * gas * workers
            assert plan.micro_batches_per_rank == gas


def test_a_model_that_does_not_fit_one_worker_is_split():
    # 16 MiB per worker: the tiny Llama's logits and activations need ~25 MiB on one
    # rank; the planner keeps the fastest layout that fits, and says why dp lost
    # (recomputation ruled out: with it, dp=4 fits; see the test after this one).
    cfg = _cfg("llama", TINY_LLAMA, num_workers=4, worker_memory_gb=16 / 1024,
               per_device_train_batch_size=8, gradient_accumulation_steps=2,
               activation_checkpointing="none")
    search = search_for_config(cfg, 4)
    c = search.chosen
    assert c.fits and c.memory.total <= 16 * 2**20 and (c.tp, c.pp) != (1, 1)
    dp4 = next(a for a in search.alternatives if (a.dp, a.tp, a.pp) == (4, 1, 1))
    assert dp4.reason.startswith("does not fit: ") and "> 16.00 MiB per worker" in dp4.reason
    slower = [a for a in search.alternatives if a.fits]
    assert slower and all(a.time.step >= c.time.step for a in slower)
    assert all(a.reason.startswith(("slower: ", "same predicted step time"))
               for a in slower)
    assert any("x predicted step time (" in a.reason for a in slower)
    plan = make_plan(cfg, 4)
    assert (plan.dp, plan.tp, plan.pp) == (c.dp, c.tp, c.pp)
    assert plan.global_batch_size == 8 * 2 * 4


def test_layout_rules_are_reasons():
    cfg = _cfg("llama", TINY_LLAMA, num_workers=8, workers_per_node=1)
    reasons = {a.reason for a in search_for_config(cfg, 8).alternatives}
    assert "tp=2 exceeds 1 workers per node" in reasons
    # the model's own limit is the reason shown first (2 key-value heads)
    assert any(r.startswith("tp=4: --tp 4 must divide the attention heads") for r in reasons)
    assert any(r.startswith("pp=8 exceeds the model's 4 blocks") for r in reasons)
    # fixed dims constrain the search
    fixed = search_for_config(_cfg("llama", TINY_LLAMA, tp=2), 8)
    assert {c.tp for c in fixed.alternatives + [fixed.chosen]} == {2}


def test_zero3_pipelines_the_runtime_refuses_are_reasons():
    """ZeRO-3 pipelines raylm does not run (the generic torch.export split, the zero-bubble
    schedule) are never chosen: the planner shows them with the reason."""
    neox = "num_hidden_layers=4,hidden_size=32,num_attention_heads=2,intermediate_size=64"
    search = search_for_config(_cfg("gpt_neox", neox, zero_stage=3, num_workers=4), 4)
    assert search.chosen.pp == 1
    pipelines = [a for a in search.alternatives if a.pp > 1]
    assert pipelines and all(a.problem for a in pipelines)
    assert any("generic torch.export split" in a.problem for a in pipelines)
    zb = search_for_config(_cfg("llama", TINY_LLAMA, zero_stage=3, pp=2, num_workers=4,
                                pipeline_schedule="zero_bubble"), 4)
    assert zb.chosen is None and zb.alternatives[0].problem.startswith(
        "--zero_stage 3 with --pipeline_schedule zero_bubble")


def test_nothing_fits_is_one_error():
    cfg = _cfg(num_workers=2, worker_memory_gb=1 / 1024)
    with pytest.raises(ConfigError) as err:
        make_plan(cfg, 2)
    msg = str(err.value)
    assert msg.startswith("no layout of 2 worker(s) fits in 1.00 MiB per worker: the smallest")
    assert "\n" not in msg


def test_flags_and_defaults_of_the_hardware():
    hw = hardware_for(TrainConfig(), {})  # no cluster (the test session may run one)
    assert not hw.use_gpu and hw.worker_memory == 16 * GIB and hw.workers_per_node == 8
    assert hw.source["worker_memory_gb"] == "default"
    gpu = hardware_for(TrainConfig(use_gpu=True, worker_memory_gb=141, network_gbps=200))
    assert gpu.worker_memory == 141 * GIB and gpu.source["worker_memory_gb"] == "flag"
    assert gpu.network_bw == 200e9 / 8 and gpu.worker_flops == 50e12
    assert gpu.mask_bytes == 1
    cluster = hardware_for(TrainConfig(), {"workers_per_node": 4, "worker_memory": 3 * GIB})
    assert (cluster.workers_per_node, cluster.worker_memory) == (4, 3 * GIB)
    assert cluster.source["workers_per_node"] == "cluster"


# -- ZeRO: the stage in the plan ----------------------------------------------------------
# A GPT-2 whose states outweigh its activations (hidden 256, 32-token blocks, micro-batches
# of 1): at dp=4 the cost model predicts 43.9 MiB per worker at stage 0, 28.8 at stage 1,
# 21.2 at stage 2 (ZeRO-3's gathered blocks make it 22.7: never the lowest that fits here).
STATES_GPT2 = "n_layer=2,n_embd=256,n_head=4,n_positions=64"
# Smaller blocks, more of them: at dp=4, 23.8 / 16.2 / 12.5 / 10.9 MiB for stages 0-3.
DEEP_GPT2 = "n_layer=4,n_embd=128,n_head=4,n_positions=64"


def _zero_cfg(overrides=STATES_GPT2, **kw) -> TrainConfig:
    kw.setdefault("per_device_train_batch_size", 1)
    # ZeRO alone (recomputation is the planner's other way to fit: tested on its own)
    kw.setdefault("activation_checkpointing", "none")
    return _cfg("gpt2", overrides, **kw)


def test_reshard_after_forward_false_is_stage_3s_and_plans_its_memory():
    plan = make_plan(_zero_cfg(dp=2, zero_stage=3, reshard_after_forward=False), 2)
    assert plan.zero_stage == 3 and not plan.reshard_after_forward
    assert "parameters kept gathered through each step" in plan.describe()
    assert make_plan(_zero_cfg(dp=2, zero_stage=3, reshard_after_forward=True),
                     2).reshard_after_forward
    for stage, named in ((None, "unset"), (2, "2")):
        with pytest.raises(ConfigError, match=r"--reshard_after_forward False needs "
                                              r"--zero_stage 3 .*is " + named):
            make_plan(_zero_cfg(dp=2, zero_stage=stage, reshard_after_forward=False), 2)
    # The planner's memory of the user's layout follows the flag.
    base = evaluate_layout(_zero_cfg(dp=2, zero_stage=3, reshard_after_forward=True),
                           2, 1, 1, zero_stage=3)
    kept = evaluate_layout(_zero_cfg(dp=2, zero_stage=3, reshard_after_forward=False),
                           2, 1, 1, zero_stage=3)
    assert kept.memory.total > base.memory.total
    assert kept.memory.parameters == base.memory.parameters


def test_reshard_after_forward_unset_keeps_gathered_where_it_fits():
    # Unset, ZeRO-3 keeps its parameters gathered through each step where the worker
    # memory holds them: in a layout the flags fix, and in the planner's own.
    resharded = evaluate_layout(_zero_cfg(dp=2, zero_stage=3, reshard_after_forward=True),
                                2, 1, 1, zero_stage=3)
    kept = evaluate_layout(_zero_cfg(dp=2, zero_stage=3), 2, 1, 1, zero_stage=3)
    assert not kept.layout.reshard_after_forward and kept.fits
    assert kept.memory.total > resharded.memory.total
    # One all-gather a step, not two a micro-batch: never slower in the cost model.
    assert kept.time.step <= resharded.time.step
    plan = make_plan(_zero_cfg(dp=2, zero_stage=3), 2)
    assert plan.zero_stage == 3 and not plan.reshard_after_forward
    assert "parameters kept gathered through each step" in plan.describe()
    searched = make_plan(_zero_cfg(num_workers=4, zero_stage=3), 4)
    assert searched.dp > 1 and not searched.reshard_after_forward
    # Memory between the two: the parameters are freed after each forward, as before.
    between = (kept.memory.total + resharded.memory.total) / 2 / GIB
    tight = make_plan(_zero_cfg(dp=2, zero_stage=3, worker_memory_gb=between), 2)
    assert tight.zero_stage == 3 and tight.reshard_after_forward
    assert "kept gathered" not in tight.describe()
    # A stage the planner chose to fit the memory is not spent on gathered parameters.
    fitted = make_plan(_zero_cfg(DEEP_GPT2, dp=4, worker_memory_gb=11.5 / 1024), 4)
    assert fitted.zero_stage == 3 and fitted.reshard_after_forward
    # Not under a pipeline (its schedule keeps them gathered anyway) or --cpu_offload.
    assert make_plan(_zero_cfg(DEEP_GPT2, dp=2, pp=2, zero_stage=3), 4).reshard_after_forward
    offload = make_plan(_zero_cfg(dp=2, zero_stage=3, use_gpu=True, cpu_offload=True), 2)
    assert offload.cpu_offload and offload.reshard_after_forward
    # Stages below 3 have nothing to gather.
    assert make_plan(_zero_cfg(dp=2, zero_stage=2), 2).reshard_after_forward


def test_pipelined_zero3_holds_its_stage_gathered_and_its_gradients_unsharded():
    # torch's pipeline schedule defers FSDP's reshard and reduce-scatter to the step's
    # last backward: each rank holds its stage's parameters gathered and their gradients
    # unsharded (fp32: 4 + 4 bytes a parameter) on top of the sharded states.
    piped = evaluate_layout(_zero_cfg(DEEP_GPT2, dp=2, pp=2, zero_stage=3,
                                      gradient_accumulation_steps=4), 2, 1, 2,
                            zero_stage=3)
    assert not piped.problem and len(piped.ranks) == 2
    for r in piped.ranks:
        assert r.workspace >= 8 * r.param_count
    flat = evaluate_layout(_zero_cfg(DEEP_GPT2, dp=4, zero_stage=3,
                                     reshard_after_forward=True), 4, 1, 1, zero_stage=3)
    assert flat.memory.workspace < 8 * flat.memory.param_count  # two blocks, one gradient


def _stage_memory(cfg, plan) -> list:
    """The cost model's peak bytes per worker of ``plan``'s layout at stages 0-3."""
    fixed = TrainConfig(**{**cfg.__dict__, "gradient_accumulation_steps":
                           plan.micro_batches_per_rank, "pipeline_schedule": plan.schedule})
    return [evaluate_layout(fixed, plan.dp, plan.tp, plan.pp, zero_stage=z).memory.total
            for z in range(4)]


def test_zero_stage_from_the_flags():
    plan = make_plan(_zero_cfg(dp=4, zero_stage=2), 4)
    assert (plan.dp, plan.zero_stage, plan.cpu_offload) == (4, 2, False)
    assert "ZeRO-2 (optimizer states and gradients partitioned over dp=4)" in plan.describe()
    # The planner searches at the stage given (each layout at ZeRO-3 here).
    plan = make_plan(_zero_cfg(num_workers=4, zero_stage=3), 4)
    assert plan.zero_stage == 3 and plan.world_size == 4
    assert ("ZeRO-3 (optimizer states, gradients and parameters partitioned over "
            f"dp={plan.dp})") in plan.describe()
    # Merak's switch is stage 1, alone or with --zero_stage 1.
    assert make_plan(_zero_cfg(dp=4, zero_optimization=True), 4).zero_stage == 1
    assert make_plan(_zero_cfg(dp=4, zero_optimization=True, zero_stage=1), 4).zero_stage == 1
    # An explicit stage holds whatever dp is; the memory-driven choice never runs for it.
    assert make_plan(_zero_cfg(dp=1, zero_stage=1, worker_memory_gb=1e-6), 1).zero_stage == 1
    assert make_plan(_zero_cfg(dp=4, zero_stage=0, worker_memory_gb=0.026), 4).zero_stage == 0
    # ZeRO-3 with sequence parallelism is a layout like any other.
    plan = make_plan(_zero_cfg(dp=2, tp=2, zero_stage=3, sequence_parallel=True), 4)
    assert (plan.zero_stage, plan.sequence_parallel, plan.tp) == (3, True, 2)
    # --cpu_offload: with GPU workers and stage 3.
    plan = make_plan(_zero_cfg(dp=4, zero_stage=3, use_gpu=True, cpu_offload=True), 4)
    assert plan.cpu_offload and "offloaded to host memory" in plan.describe()
    assert "ZeRO" not in make_plan(_zero_cfg(dp=4), 4).describe()


@pytest.mark.parametrize("kw, words", [
    (dict(zero_optimization=True, zero_stage=2), ["--zero_optimization", "--zero_stage 2"]),
    (dict(zero_optimization=True, zero_stage=0), ["--zero_optimization", "--zero_stage 0"]),
    (dict(cpu_offload=True, zero_stage=1), ["--cpu_offload needs --use_gpu"]),
    (dict(cpu_offload=True, zero_stage=0, use_gpu=True),
     ["--cpu_offload needs --zero_stage 3", "is 0"]),
    (dict(cpu_offload=True, zero_stage=2, use_gpu=True),
     ["--cpu_offload needs --zero_stage 3", "do not offload yet", "is 2"]),
    (dict(cpu_offload=True, use_gpu=True), ["--cpu_offload needs --zero_stage", "unset"]),
])
def test_zero_flag_errors_are_one_line(kw, words):
    for layout in (dict(dp=4), dict(num_workers=4)):  # the user's layout and the planner's
        with pytest.raises(ConfigError) as err:
            make_plan(_zero_cfg(**layout, **kw), 4)
        msg = str(err.value)
        assert "\n" not in msg and all(w in msg for w in words), msg


def test_unset_stage_is_0_when_memory_is_ample():
    for workers in (1, 2, 4):
        plan = make_plan(_zero_cfg(num_workers=workers), workers)
        assert plan.zero_stage == 0 and plan.dp == workers
    plan = make_plan(_zero_cfg(dp=4), 4)
    assert plan.zero_stage == 0
    # dp=1: nothing to partition, so nothing to choose, however short the memory.
    assert make_plan(_zero_cfg(pp=2, gradient_accumulation_steps=2,
                                worker_memory_gb=0.026), 2).zero_stage == 0


@pytest.mark.parametrize("memory_gb, stage", [(0.04, 1), (0.026, 2)])
def test_planner_takes_the_lowest_stage_that_fits(memory_gb, stage):
    cfg = _zero_cfg(num_workers=4, worker_memory_gb=memory_gb)
    search = search_for_config(cfg, 4)
    plan = make_plan(cfg, 4)
    c = search.chosen
    assert (plan.dp, plan.tp, plan.pp) == (c.dp, c.tp, c.pp) == (4, 1, 1)
    assert plan.zero_stage == c.zero_stage == stage
    limit = memory_gb * GIB
    mem = _stage_memory(cfg, plan)
    assert mem[stage] <= limit < mem[stage - 1]  # fits; the stage below does not
    assert c.memory.total == pytest.approx(mem[stage])
    assert all(mem[s] > limit for s in range(stage))
    assert set(c.zero_tried) == set(range(stage + 1))
    # Every fitting alternative is slower, each at its own lowest fitting stage.
    for a in search.alternatives:
        if a.fits:
            assert a.time.step >= c.time.step
            if a.zero_stage:
                assert a.zero_tried[a.zero_stage - 1] > limit
    # Gradients summed in bf16: stages 1 and 2 (fp32 reduce-scatters) are passed over.
    bf16 = dataclasses.replace(cfg, bf16=True, reduce_dtype="bfloat16")
    assert make_plan(bf16, 4).zero_stage == 3
    assert set(search_for_config(bf16, 4).chosen.zero_tried) == {0, 3}


def test_the_users_layout_takes_the_lowest_stage_that_fits():
    cfg = _zero_cfg(DEEP_GPT2, dp=4, worker_memory_gb=11.5 / 1024)
    plan = make_plan(cfg, 4)
    mem = _stage_memory(cfg, plan)
    assert (plan.dp, plan.tp, plan.pp, plan.zero_stage) == (4, 1, 1, 3)
    assert mem[3] <= 11.5 * 2**20 < mem[2]
    # Nothing fits at any stage: stage 0, and the layout is left as the user gave it.
    plan = make_plan(_zero_cfg(DEEP_GPT2, dp=4, worker_memory_gb=1 / 1024), 4)
    assert (plan.dp, plan.zero_stage) == (4, 0)
    # The planner, for the same workers, says what ZeRO-3 would still need.
    search = search_for_config(_zero_cfg(DEEP_GPT2, num_workers=4,
                                         worker_memory_gb=1 / 1024), 4)
    assert search.chosen is None
    dp4 = next(a for a in search.alternatives if (a.dp, a.tp, a.pp) == (4, 1, 1))
    assert dp4.zero_stage == 0 and not dp4.fits and list(dp4.zero_tried) == [0, 1, 2, 3]
    assert dp4.zero_tried[3] == pytest.approx(mem[3])
    assert dp4.reason.endswith(f"; {human_bytes(mem[3])} with ZeRO-3")


# -- ZeRO: which rank owns which partition -------------------------------------------------
def _spec(cfg):
    from raylm.models.loading import resolve_block_size, resolve_model

    spec = resolve_model(cfg)
    return spec, resolve_block_size(cfg, spec)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ownership_splits_every_tensor_over_dp(stage):
    from raylm.report.ownership import ownership_lines, zero_ownership

    cfg = _zero_cfg(dp=4, zero_stage=stage)
    spec, seq = _spec(cfg)
    plan = make_plan(cfg, 4, spec, seq)
    shapes = {n: tuple(p.shape) for n, p in _meta(spec).named_parameters()}
    total = sum(math.prod(s) for s in shapes.values())
    owners = zero_ownership(spec, plan, seq)
    assert [e["rank"] for e in owners] == [0, 1, 2, 3]
    assert [e["coords"] for e in owners] == [{"dp": d, "pp": 0, "tp": 0} for d in range(4)]
    owned = [e["elements"]["owned"] for e in owners]
    assert sum(owned) == total and all(e["elements"]["held"] == total for e in owners)
    one_row = sum(math.prod(s[1:]) for s in shapes.values())  # a row of every tensor
    assert all(abs(o - total / 4) <= one_row for o in owned), owned
    for name, shape in shapes.items():  # the dp ranks' rows tile each tensor's dim 0
        ranges = [e["rows"][name] for e in owners]
        assert ranges[0][0] == 0 and ranges[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for e in owners:  # bytes: fp32 + AdamW, partitioned from the stage on
        kept = {c: e["elements"]["owned"] if c in e["partitioned"] else total
                for c in ("parameters", "gradients", "optimizer")}
        assert e["partitioned"] == ["optimizer", "gradients", "parameters"][:stage]
        assert e["bytes"] == {"parameters": 4 * kept["parameters"],
                              "gradients": 4 * kept["gradients"],
                              "optimizer": 8 * kept["optimizer"],
                              "total": 4 * kept["parameters"] + 4 * kept["gradients"]
                              + 8 * kept["optimizer"]}
    lines = ownership_lines(owners, plan.dp)
    assert lines[0].startswith(f"ZeRO-{stage} ownership: each of the dp=4 ranks")
    assert len(lines) == 2 and "global ranks 0-3" in lines[1]
    assert f"{len(shapes)} tensors, {total:,} elements" in lines[1]


def test_ownership_at_a_thousand_data_parallel_ranks_is_each_rank_s_own():
    """dp=1,000 (more ranks than most tensors have rows: the last ranks own nothing of
    them): each rank's counts, computed for all ranks at once, are what owned_partition
    gives that rank alone; without rows (the driver's log) the counts are the same."""
    from raylm.plan.zero import owned_partition
    from raylm.report.ownership import zero_ownership

    cfg = _zero_cfg(dp=1000, zero_stage=3)
    spec, seq = _spec(cfg)
    plan = make_plan(cfg, 1000, spec, seq)
    shapes = {n: tuple(p.shape) for n, p in _meta(spec).named_parameters()}
    assert min(s[0] for s in shapes.values()) < 1000 < max(s[0] for s in shapes.values())
    owners = zero_ownership(spec, plan, seq)
    bare = zero_ownership(spec, plan, seq, rows_limit=0)
    assert len(owners) == len(bare) == 1000 and not any("rows" in e for e in bare)
    for e, b in zip(owners, bare):
        rows, owned = owned_partition(shapes, 1000, e["coords"]["dp"])
        assert e["rows"] == rows and e["elements"]["owned"] == owned
        assert b["elements"] == e["elements"] and b["bytes"] == e["bytes"]
    assert sum(e["elements"]["owned"] for e in owners) == owners[0]["elements"]["held"]
    assert owners[-1]["elements"]["owned"] < owners[0]["elements"]["owned"]


def _meta(spec):
    from raylm.models.units import meta_model

    return meta_model(spec)


def test_ownership_of_a_3d_layout_agrees_with_the_cost_model():
    """dp=2 x pp=2 x tp=2, ZeRO-3: each rank holds its stage's tp shard (what the cost
    model counts), and its dp group splits that; GPT-2's tied table sits on both pp
    ranks."""
    from raylm.plan.layout import plan_pipeline
    from raylm.report.ownership import ownership_lines, zero_ownership
    from raylm.report.plan_report import build_plan_report

    cfg = _cfg("gpt2", TINY_GPT2, dp=2, tp=2, pp=2, zero_stage=3,
               gradient_accumulation_steps=2)
    spec, seq = _spec(cfg)
    plan, _ = plan_pipeline(cfg, spec, make_plan(cfg, 8, spec, seq), seq)
    owners = zero_ownership(spec, plan, seq)
    assert len(owners) == 8
    rep = build_plan_report(cfg)
    for e in owners:
        c = e["coords"]
        assert e["rank"] == c["dp"] * 4 + c["pp"] * 2 + c["tp"]
        assert e["elements"]["held"] == rep["ranks"][c["pp"]]["local_parameters"]
        group = [o for o in owners if (o["coords"]["pp"], o["coords"]["tp"])
                 == (c["pp"], c["tp"])]
        assert sum(o["elements"]["owned"] for o in group) == e["elements"]["held"]
        assert e["elements"]["parameters"] == e["elements"]["owned"]  # stage 3
    wte = "transformer.wte.weight"
    assert all(wte in e["rows"] for e in owners)  # the tied table, on both pp ranks
    lines = ownership_lines(owners, 2)
    assert len(lines) == 3  # a header, one line per pp rank (equal tp shards merged)
    assert "pp rank 0, tp rank(s) 0-1 (global ranks 0-1, 4-5)" in lines[1]


def _odd_vocab_model(name, device=None):
    """A test model with a vocabulary of 101, which tp=2 pads to 102."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**MODELS[name], "vocab_size": 101}
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(config)


def _tp_shapes_rank(rank: int, port: int, queue) -> None:
    """One rank of tp=2: the local shapes raylm's tensor parallelism gives each parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from raylm.parallel.tensor import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        out = {}
        for name in MODELS:
            model = _odd_vocab_model(name)
            apply_tensor_parallel(model, mesh)
            out[name] = {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
                         for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    queue.put((rank, out))


def test_ownership_shapes_are_the_runtimes_tensor_parallel_shards():
    """The shapes the planner and the ownership table derive for tp=2 (GPT-2's Conv1D as
    nn.Linear, the vocabulary of 101 padded to 102, colwise and rowwise splits,
    replicated norms) are those apply_tensor_parallel gives each parameter on two real
    gloo ranks (which also checks the global shapes and shard dims itself)."""
    from raylm.models.tensor_plans import tensor_parallel_shapes

    results, procs = run_ranks(_tp_shapes_rank, 2)
    for name in MODELS:
        shapes = tensor_parallel_shapes(_odd_vocab_model(name, "meta"), 2)
        for rank in range(2):
            assert shapes.local(rank) == results[rank][name], (name, rank)
    assert results[0]["llama"]["lm_head.weight"] == (51, 64)  # 102 / 2 rows


# -- raylm plan --------------------------------------------------------------------------
def test_plan_prints_the_choice_memory_time_and_alternatives(capsys):
    args = ["plan", "--model_type", "gpt2", "--config_overrides", TINY_GPT2,
            "--block_size", "32", "--num_workers", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "chosen by the planner: dp=4 x tp=1 x pp=1" in out
    assert "memory per worker: parameters " in out and "optimizer states" in out
    assert "of 16.00 GiB" in out
    assert "assumed: worker memory 16 GiB: the CPU default (no Ray cluster connected" in out
    assert "step: predicted " in out and "tokens/s" in out
    assert "alternatives (next best first):" in out and "slower: " in out

    assert main([*args, "--json", "--worker_memory_gb", "4"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["planner"]["searched"] and rep["fits"]
    assert (rep["chosen"]["dp"], rep["chosen"]["tp"], rep["chosen"]["pp"]) == (4, 1, 1)
    assert rep["worker_memory"] == 4 * GIB and rep["hardware"]["source"]["worker_memory_gb"] \
        == "flag"
    assert not any("worker memory" in a for a in rep["assumed"])
    mem = rep["memory"]
    assert mem["total"] == pytest.approx(mem["parameters"] + mem["gradients"]
                                         + mem["optimizer"] + mem["activations"]
                                         + mem["workspace"])
    assert rep["time"]["step"] > 0 and rep["time"]["tokens_per_s"] > 0
    assert 1 <= len(rep["alternatives"]) <= 5
    assert all(a["reason"] for a in rep["alternatives"])


@pytest.mark.parametrize("zero", ["0", None])
def test_70b_llama_on_1024_workers_plans_in_seconds(capsys, zero):
    start = time.monotonic()
    rc = main(["plan", "--json", "--model_type", "llama", "--config_overrides", LLAMA_70B,
               "--num_workers", "1024", "--block_size", "2048",
               "--per_device_train_batch_size", "1", "--use_gpu"]
              + (["--zero_stage", zero] if zero else []))
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert elapsed < 30, f"planning took {elapsed:.1f} s"
    rep = json.loads(out)
    c = rep["chosen"]
    print(f"70B on 1024: {elapsed:.2f} s (search {rep['planner']['elapsed_s']:.2f} s), "
          f"dp={c['dp']} tp={c['tp']} pp={c['pp']} {c['schedule']} ZeRO-{c['zero_stage']}, "
          f"{rep['memory']['total'] / GIB:.1f} GiB")
    assert c["dp"] * c["tp"] * c["pp"] == 1024
    assert rep["fits"] and rep["memory"]["total"] <= 80 * GIB
    assert rep["planner"]["evaluated"] > 50
    assert rep["model"]["parameters"] > 70e9
    stages = rep["zero"]["stages"]
    if zero == "0":  # without ZeRO, only tensor and pipeline parallelism shard the states
        assert c["zero_stage"] == 0 and stages[0]["chosen"] and stages[0]["fits"]
        assert c["tp"] <= 8 and c["pp"] > 1  # 1.1 TB of fp32 states need both
    else:  # unset: the lowest stage at which the fastest layout fits
        z = c["zero_stage"]
        assert z >= 1 and stages[z]["chosen"] and stages[z]["fits"]
        assert not stages[z - 1]["fits"]
        assert c["zero_tried"] and all(c["zero_tried"][str(s)] > 80 * GIB for s in range(z))


@pytest.mark.parametrize("model_type, overrides, flags, message", [
    ("gpt_neox", "num_hidden_layers=2,hidden_size=32,num_attention_heads=4,"
     "intermediate_size=64,max_position_embeddings=64", ["--gradient_checkpointing"],
     "raylm cuts 'gpt_neox' into stages by tracing it with torch.export"),
    ("gpt2", TINY_GPT2, ["--activation_checkpointing", "selective", "--pipeline_schedule",
                         "zero_bubble"], "selective with --pipeline_schedule zero_bubble"),
])
def test_recomputation_a_pipeline_cannot_run_is_one_error(capsys, model_type, overrides,
                                                          flags, message):
    rc = main(["plan", "--model_type", model_type, "--config_overrides", overrides,
               "--block_size", "32", "--pp", "2", "--gradient_accumulation_steps", "4"]
              + flags)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_70b_llama_at_sequence_4096_fits_with_what_the_planner_adds(capsys):
    """The planner's own memory settings: at sequence 4096 no layout of the 1024 workers
    fits in 80 GB with every activation kept and whole sequences on every tp rank; left
    to the planner, sequence parallelism and recomputation are searched with the rest."""
    args = ["plan", "--model_type", "llama", "--config_overrides", LLAMA_70B,
            "--num_workers", "1024", "--block_size", "4096", "--per_device_train_batch_size",
            "1", "--use_gpu", "--worker_memory_gb", "80"]
    assert main(args + ["--activation_checkpointing", "none",
                        "--sequence_parallel", "false"]) == 2
    assert "no layout of 1024 worker(s) fits in 80.00 GiB" in capsys.readouterr().err
    start = time.monotonic()
    assert main(args + ["--json"]) == 0
    elapsed = time.monotonic() - start
    rep = json.loads(capsys.readouterr().out)
    c, rc = rep["chosen"], rep["recompute"]
    print(f"70B at 4096: {elapsed:.2f} s, {rep['layout']}, {rep['memory']['total'] / GIB:.1f} "
          "GiB")
    assert elapsed < 30 and rep["fits"] and rep["memory"]["total"] <= 80 * GIB
    assert c["sequence_parallel"] or c["recompute"] != "none"
    assert (c["recompute"], c["sequence_parallel"]) == (rc["recompute"],
                                                         rc["sequence_parallel"])
    assert rc["chosen_by"] == "planner: the fastest setting that fits"
    options = {(o["recompute"], o["sequence_parallel"]): o for o in rc["options"]}
    assert not options[("none", False)]["fits"]  # what the user would have had to fix
    chosen = options[(c["recompute"], c["sequence_parallel"])]
    assert chosen["chosen"] and chosen["fits"]
    # The fastest that fits: every faster setting of this layout does not fit.
    assert all(not o["fits"] for o in rc["options"] if o["step"] < chosen["step"] * 0.999)
    # Full recomputation costs a forward more than keeping the activations.
    assert options[("full", False)]["step"] > options[("none", False)]["step"] * 1.2
    # The text says the same.
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "activation checkpointing (per worker" in out and "<- chosen" in out


def test_70b_llama_in_bf16_plans_with_16_bit_activations_and_weight_copies(capsys):
    """--bf16: the same 70B at sequence 4096 on 1024 x 80 GB plans in seconds with the
    mixed-precision memory model (fp32 states, 16-bit matmul activations, autocast's
    weight copies) and the GPU's tensor-core speed; `raylm plan` says so."""
    args = ["plan", "--model_type", "llama", "--config_overrides", LLAMA_70B,
            "--num_workers", "1024", "--block_size", "4096", "--per_device_train_batch_size",
            "1", "--use_gpu", "--worker_memory_gb", "80", "--bf16"]
    assert main(args + ["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["fits"] and rep["memory"]["total"] <= 80 * GIB
    assert rep["estimate"]["precision"] == "bf16" and rep["hardware"]["worker_tflops"] == 400
    mem, c = rep["memory"], rep["chosen"]
    # autocast's copies of the rank's matrices (ZeRO-3 gathers 16-bit blocks instead)
    assert (mem["weight_copies"] > 0) == (c["zero_stage"] < 3)
    options = {(o["recompute"], o["sequence_parallel"]): o
               for o in rep["recompute"]["options"]}
    if c["pp"] > 1:  # sequence parallelism is not offered where the layout cannot run it
        assert not any(sp for _, sp in options)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "memory: bf16 training with AdamW (fp32 weights" in out
    assert "400 TFLOP/s (bf16/fp16)" in out or "400 TFLOP/s per worker" in out


def test_plan_with_address_reads_the_cluster(ray_cluster, capsys):
    from tests.conftest import RAY_CPUS

    rc = main(["plan", "--json", "--address", "auto", "--model_type", "gpt2",
               "--config_overrides", TINY_GPT2, "--block_size", "32"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["planner"]["num_workers"] == RAY_CPUS  # the cluster's size
    assert rep["hardware"]["workers_per_node"] == RAY_CPUS
    assert rep["hardware"]["source"]["worker_memory_gb"] == "cluster"
    node = next(n for n in ray_cluster.nodes() if n["Alive"])
    assert rep["worker_memory"] == pytest.approx(node["Resources"]["memory"] / RAY_CPUS)
    assert not any("worker memory" in a for a in rep["assumed"])
