"""T5 span corruption: the lengths and noise masks of T5's reference algorithm, the
corrupted inputs and targets, and parity of dp, tp and pp with one process under the same
corruption (tests/reference.py shares raylm's corrupt_spans, a function of seed, epoch and
sample id, as it shares the sampler's order)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

from raylm import TrainConfig, train
from raylm.data.reader import IGNORE_INDEX
from raylm.models.objectives import Spans, corrupt_spans, noise_mask, span_lengths
from tests.numerics import assert_steps_match, assert_weights_match
from tests.reference import reference_fixture

STEPS = 3
GLOBAL_BATCH = 8
MICRO = 2
TINY_T5 = ("num_layers=2,num_decoder_layers=2,d_model=32,d_kv=8,d_ff=64,num_heads=4,"
           "dropout_rate=0.0")
SENTINELS = 20


def t5_tokenizer(corpus, cache_root) -> str:
    """A byte-level BPE with T5's sentinel tokens, trained once per session."""
    from raylm.data.tokenizer_train import train_tokenizer

    out = os.path.join(cache_root, "bpe-t5")
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        train_tokenizer(sorted(str(p) for p in corpus.iterdir()), out, vocab_size=1000,
                        extra_ids=SENTINELS)
    return out


def t5_config(out, corpus, cache_root, model="t5", **kw) -> TrainConfig:
    dp = kw.get("dp", 1)
    base = dict(model_type=model, config_overrides=TINY_T5,
                tokenizer_name=t5_tokenizer(corpus, cache_root), train_file=[str(corpus)],
                block_size=32, data_cache_dir=cache_root, output_dir=str(out),
                max_steps=STEPS, logging_steps=1, save_steps=1000, disable_tqdm=True,
                learning_rate=1e-3, warmup_steps=1, per_device_train_batch_size=MICRO,
                cpus_per_worker=0.5, gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * dp))
    base.update(kw)
    return TrainConfig(**base)


reference = reference_fixture("t5-spans", t5_config, GLOBAL_BATCH, STEPS)


def spans(**kw) -> Spans:
    base = dict(seed=0, density=0.15, mean_span=3.0, sentinel_ids=tuple(range(999, 899, -1)),
                eos_id=1, pad_id=0, start_id=0)
    base.update(kw)
    return Spans(**base)


def t5_reference_noise_mask(length: int, density: float, mean_span: float) -> np.ndarray:
    """T5's random_spans_noise_mask (t5/data/preprocessors.py; run_t5_mlm_flax.py's copy),
    written out with loops, drawing from numpy's global generator as they do: the noise
    spans' lengths from one shuffle of the cut points, then the other spans' from a
    second; the spans alternate, non-noise first."""
    noise = min(max(int(np.round(length * density)), 1), length - 1)
    n_spans = max(int(np.round(noise / mean_span)), 1)

    def segmentation(items):
        cut_after = np.arange(items - 1) < n_spans - 1
        np.random.shuffle(cut_after)
        lengths, run = [], 1
        for cut in cut_after:
            if cut:
                lengths.append(run)
                run = 1
            else:
                run += 1
        return lengths + [run]

    noise_lengths = segmentation(noise)
    kept_lengths = segmentation(length - noise)
    mask = []
    for kept, noisy in zip(kept_lengths, noise_lengths):
        mask += [False] * kept + [True] * noisy
    return np.array(mask)


def test_lengths_and_noise_masks_are_t5s():
    # run_t5_mlm_flax's lengths for T5's 512-token inputs: 568 raw tokens, 114 targets.
    assert span_lengths(512, 0.15, 3.0) == (568, 114)
    for density, mean in ((0.15, 3.0), (0.3, 2.0), (0.5, 3.0)):
        s = spans(density=density, mean_span=mean)
        for n_in in (16, 33, 64, 128, 511):
            tokens, n_out = span_lengths(n_in, density, mean)
            assert s.lengths(tokens) == (n_in, n_out)  # exactly the encoder's length
            assert s.lengths(tokens + 2)[0] > n_in  # and the longest sample that fits
    # The same draws give T5's masks.
    for seed in range(200):
        length = 20 + seed % 97
        s = spans(density=(0.15, 0.3)[seed % 2], mean_span=(3.0, 2.0)[seed % 3 == 0])
        np.random.seed(seed)
        expected = t5_reference_noise_mask(length, s.density, s.mean_span)
        got = noise_mask(length, s, np.random.RandomState(seed))
        assert np.array_equal(got, expected), seed


def test_corrupted_inputs_and_targets():
    """Inputs keep the non-noise tokens with a sentinel per cut span, then EOS; targets
    hold the spans, each behind its sentinel, then EOS: together they give back the
    sample. Lengths are fixed; a sample's corruption depends on (seed, epoch, id) only."""
    s = spans()
    tokens, n_out = span_lengths(64, s.density, s.mean_span)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 800, (50, tokens), generator=g)
    sample_ids = torch.arange(50)
    sample_ids[3] = -1  # a filler row
    inputs, labels = corrupt_spans(ids, sample_ids, s, epoch=0)
    assert inputs.shape == (50, 64) and labels.shape == (50, n_out)
    real = [i for i in range(50) if i != 3]
    assert (inputs[real, -1] == 1).all() and (labels[real, -1] == 1).all()  # EOS
    assert (labels[3] == IGNORE_INDEX).all() and (inputs[3] == 0).all()
    for row in (0, 7, 49):
        inp, tgt = inputs[row, :-1].tolist(), labels[row, :-1].tolist()
        # Targets: sentinel k, then the k-th span (T5's format, <extra_id_0> first).
        pieces, k = {}, None
        for t in tgt:
            if t in s.sentinel_ids:
                k = t
                pieces[k] = []
            else:
                pieces[k].append(t)
        assert list(pieces) == list(s.sentinel_ids[:len(pieces)])
        rebuilt = [x for t in inp for x in (pieces[t] if t in pieces else [t])]
        assert rebuilt == ids[row].tolist()
    order = torch.tensor([49, 7, 0])
    again = corrupt_spans(ids[order], sample_ids[order], s, epoch=0)
    assert torch.equal(again[0], inputs[order]) and torch.equal(again[1], labels[order])
    assert not torch.equal(corrupt_spans(ids, sample_ids, s, epoch=1)[0], inputs)


RUNS = [(2, 1, 1), (1, 1, 2), (1, 2, 1)]  # (dp, pp, tp)


# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_span_corruption_layout_matches_single_process": {"dp1-pp2-tp1"},
}


@pytest.mark.parametrize("dp,pp,tp", RUNS, ids=[f"dp{d}-pp{p}-tp{t}" for d, p, t in RUNS])
def test_span_corruption_layout_matches_single_process(dp, pp, tp, reference, ray_cluster,
                                                       corpus_dir, cache_root, tmp_path):
    result = train(t5_config(tmp_path / "out", corpus_dir, cache_root, dp=dp, pp=pp, tp=tp,
                             num_workers=dp * pp * tp))
    ref = reference("t5")
    assert_steps_match(result.history, ref, STEPS, label=result.output_dir)
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    # 8 samples of 34 raw tokens read; 8 targets of 8 tokens predicted.
    assert [h["tokens"] for h in result.history] == [GLOBAL_BATCH * 8] * STEPS
    assert [h["throughput_tokens"] for h in result.history] == [GLOBAL_BATCH * 34] * STEPS
    assert AutoConfig.from_pretrained(result.output_dir).architectures == \
        ["T5ForConditionalGeneration"]
    saved = AutoModelForSeq2SeqLM.from_pretrained(result.output_dir).state_dict()
    assert_weights_match(saved, ref.state, ref.exact, ref.lr_sum, label=result.output_dir,
                         allowance=ref.allowance)
