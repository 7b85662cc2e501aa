"""Pipeline parallelism: every schedule and stage count reproduces single-process training.

Loss parity as everywhere in raylm: fp32 per-step losses equal a plain PyTorch loop on the
same samples within 1e-5 relative, and the saved model (one ordinary Hugging Face model,
whatever the layout) has the reference's weights.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from raylm import TrainConfig, train
from tests.conftest import CPUS
from tests.numerics import assert_steps_match, assert_weights_match
from tests.reference import reference_fixture

STEPS = 3
GLOBAL_BATCH = 8
MICRO = 2  # 4 micro-batches per step on one replica

# 8 blocks so that pp=4 can also run 2 stages per rank (interleaved, zero bubble).
MODELS = {
    "gpt2": ("gpt2", "n_layer=8,n_embd=32,n_head=2,n_positions=64,"
                     "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"),  # tied wte / lm_head
    "llama": ("llama", "num_hidden_layers=8,hidden_size=32,num_attention_heads=4,"
                       "num_key_value_heads=2,intermediate_size=64,max_position_embeddings=64"),
    "t5": ("t5", "num_layers=2,num_decoder_layers=2,d_model=32,d_kv=8,d_ff=64,num_heads=4,"
                 "dropout_rate=0.0"),
    # No layer list in raylm: cut by the generic torch.export path.
    "gpt_neox": ("gpt_neox", "num_hidden_layers=4,hidden_size=32,num_attention_heads=2,"
                             "intermediate_size=64,max_position_embeddings=64,"
                             "hidden_dropout=0.0,attention_dropout=0.0"),
    "bert": ("bert", "num_hidden_layers=4,hidden_size=32,num_attention_heads=2,"
                     "intermediate_size=64,max_position_embeddings=64,is_decoder=True,"
                     "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"),
}


def pp_config(out, corpus, cache_root, model="gpt2", models=None, **kw) -> TrainConfig:
    model_type, overrides = (models or MODELS)[model]
    base = dict(model_type=model_type, config_overrides=overrides, train_file=[str(corpus)],
                block_size=32, data_cache_dir=cache_root, output_dir=str(out), max_steps=STEPS,
                logging_steps=1, save_steps=1000, disable_tqdm=True, learning_rate=1e-3,
                warmup_steps=1, per_device_train_batch_size=MICRO,
                gradient_accumulation_steps=GLOBAL_BATCH // MICRO, cpus_per_worker=CPUS)
    if model_type == "t5":  # block continuation (span corruption: tests/test_t5_spans.py)
        base["objective"] = "seq2seq"
    base.update(kw)
    return TrainConfig(**base)


# Single-process losses and final weights, per model (computed once).
reference = reference_fixture("pipeline", pp_config, GLOBAL_BATCH, STEPS)


def assert_parity(result, ref, steps=STEPS):
    assert_steps_match(result.history, ref, steps, label=result.output_dir)
    assert result.history[-1]["loss"] != result.history[0]["loss"]  # it trained
    # The output is one ordinary Hugging Face model: load it with transformers (which
    # also undoes the legacy names some models are saved under, e.g. GPT-NeoX's embed_out).
    config = AutoConfig.from_pretrained(result.output_dir)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    saved = auto.from_pretrained(result.output_dir).state_dict()
    assert_weights_match(saved, ref.state, ref.exact, ref.lr_sum, label=result.output_dir,
                         allowance=ref.allowance)


def assert_recomputed(output_dir, mode):
    """The run used activation checkpointing ``mode``, and with it every rank really ran
    checkpointed blocks (counted in each rank, memory.json)."""
    with open(os.path.join(output_dir, "memory.json")) as f:
        report = json.load(f)
    assert report["layout"]["recompute"] == mode
    blocks = [r["checkpointed_blocks"] for r in report["ranks"]]
    assert all(b > 0 for b in blocks) if mode != "none" else not any(blocks), blocks


# Every pair of (schedule, stage count, model) once, not the whole cross-product: what a
# schedule does is the same for each model, and a model's stages the same under each
# schedule. In order of pp: each run takes the last one's rank processes (kept_ranks).
CASES = [(2, "gpipe", "gpt2"), (2, "1f1b", "gpt2"), (2, "interleaved_1f1b", "llama"),
         (2, "zero_bubble", "llama"), (4, "gpipe", "llama"), (4, "1f1b", "llama"),
         (4, "interleaved_1f1b", "gpt2"), (4, "zero_bubble", "gpt2")]
# Some runs recompute their blocks in backward (activation checkpointing): each schedule
# runs the recomputation inside its own backward (zero bubble's split one too: full only).
RECOMPUTE = {("gpt2", 2, "1f1b"): "full", ("llama", 2, "zero_bubble"): "full",
             ("gpt2", 4, "interleaved_1f1b"): "selective", ("llama", 4, "gpipe"): "full"}

# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_pipeline_matches_single_process": {"2-1f1b-gpt2", "2-zero_bubble-llama",
                                             "4-interleaved_1f1b-gpt2"},
    "test_pipeline_other_models": {"t5", "gpt_neox"},
}


@pytest.mark.parametrize("model", ["bert", "t5", "gpt_neox"])
def test_pipeline_other_models(model, reference, ray_cluster, corpus_dir, cache_root,
                               tmp_path):
    """BERT (as a causal LM, is_decoder), T5 (one chain: encoder stages, then decoder
    stages, the encoder output carried along; block-continuation objective) and GPT-NeoX
    (no layer list in raylm: the generic torch.export split)."""
    mode = "full" if model == "t5" else "none"
    cfg = pp_config(tmp_path / "out", corpus_dir, cache_root, model, pp=2, num_workers=2,
                    activation_checkpointing=mode)
    result = train(cfg)
    assert_parity(result, reference(model))
    assert_recomputed(result.output_dir, mode)


@pytest.mark.parametrize("pp,schedule,model", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_pipeline_matches_single_process(model, pp, schedule, reference, ray_cluster,
                                         corpus_dir, cache_root, tmp_path):
    mode = RECOMPUTE.get((model, pp, schedule), "none")
    cfg = pp_config(tmp_path / "out", corpus_dir, cache_root, model, pp=pp, num_workers=pp,
                    pipeline_schedule=schedule, activation_checkpointing=mode)
    result = train(cfg)
    assert result.metrics["world_size"] == pp
    assert_parity(result, reference(model))
    assert_recomputed(result.output_dir, mode)


@pytest.mark.slow
def test_data_parallel_times_pipeline(reference, ray_cluster, corpus_dir, cache_root,
                                      tmp_path):
    # dp=2 x pp=2: each replica runs 2 micro-batches through its own pipeline; gradients
    # are summed over dp per stage and between the tied wte copies per replica.
    cfg = pp_config(tmp_path / "out", corpus_dir, cache_root, "gpt2", pp=2, num_workers=4,
                    gradient_accumulation_steps=2)
    result = train(cfg)
    assert result.metrics["world_size"] == 4
    assert_parity(result, reference("gpt2"))


@pytest.mark.slow
def test_manual_split_and_short_last_step(ray_cluster, corpus_dir, cache_root, tmp_path):
    """--pp_split is honoured, and an epoch's short last step (filled up with padding
    rows) trains on exactly its samples: the losses equal an unpipelined run's."""
    small = tmp_path / "small"
    small.mkdir()
    (small / "part.txt").write_text(open(os.path.join(corpus_dir, "macbeth.txt")).read()[:7000])
    kw = dict(max_steps=-1, num_train_epochs=1.0, do_eval=False)
    flat = train(pp_config(tmp_path / "flat", small, cache_root, num_workers=1, **kw))
    piped = train(pp_config(tmp_path / "piped", small, cache_root, pp=2, num_workers=2,
                            pp_split="6", **kw))
    assert len(flat.history) == len(piped.history) > 1
    assert [h["tokens"] for h in piped.history] == [h["tokens"] for h in flat.history]
    assert piped.history[-1]["tokens"] < piped.history[0]["tokens"], "no short last step"
    np.testing.assert_allclose([h["loss"] for h in piped.history],
                               [h["loss"] for h in flat.history], rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_moves_between_pipeline_layouts(reference, ray_cluster, corpus_dir,
                                                   cache_root, tmp_path):
    """A checkpoint written under pp=2 resumes under pp=1 and under pp=4 with the same
    following losses (keys are the model's own parameter names, whatever the layout)."""
    ref_losses = reference("gpt2").losses
    first = train(pp_config(tmp_path / "pp2", corpus_dir, cache_root, pp=2, num_workers=2,
                            save_steps=1))
    ckpt = os.path.join(first.output_dir, "checkpoints", "step-00000001")
    assert os.path.isdir(ckpt)
    for pp in (1, 4):
        resumed = train(pp_config(tmp_path / f"pp{pp}", corpus_dir, cache_root, pp=pp,
                                  num_workers=pp, resume_from_checkpoint=ckpt))
        steps = [h["step"] for h in resumed.history]
        assert steps == list(range(2, STEPS + 1)), steps
        np.testing.assert_allclose([h["loss"] for h in resumed.history], ref_losses[1:],
                                   rtol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_preposted_orders_run_to_the_end_and_hold_the_expected_micro_batches(schedule):
    """The op orders of the schedules CPU ranks run with their receives posted up front
    (raylm.parallel.pipeline.runtime.GLOO_CLASSES), played with every dependency (a
    forward needs the stage before's, a backward its own forward and the next stage's
    backward; sends never block): every stage runs each forward and backward once,
    nothing waits forever, and a stage holds at most the micro-batches its schedule
    promises (GPipe all m, 1F1B min(m, p - s)) between a forward and its backward."""
    from raylm.parallel.pipeline.runtime import GLOO_CLASSES

    order = GLOO_CLASSES[schedule].order
    for p in (2, 3, 4):
        for m in (p, p + 1, 2 * p + 3):
            todo = {s: list(order(s, p, m)) for s in range(p)}
            for s, ops in todo.items():
                assert sorted(ops) == sorted([("F", i) for i in range(m)]
                                             + [("B", i) for i in range(m)]), (p, m, s)
            done, held, peak = set(), [0] * p, [0] * p
            while any(todo.values()):
                moved = False
                for s in range(p):
                    if not todo[s]:
                        continue
                    kind, i = todo[s][0]
                    if kind == "F":
                        ready = s == 0 or ("F", s - 1, i) in done
                    else:
                        ready = ("F", s, i) in done and (s == p - 1 or ("B", s + 1, i) in done)
                    if ready:
                        todo[s].pop(0)
                        done.add((kind, s, i))
                        held[s] += 1 if kind == "F" else -1
                        peak[s] = max(peak[s], held[s])
                        moved = True
                assert moved, f"{schedule} p={p} m={m}: stuck at {todo}"
            want = [m] * p if schedule == "gpipe" else [min(m, p - s) for s in range(p)]
            assert peak == want, (p, m, peak)
