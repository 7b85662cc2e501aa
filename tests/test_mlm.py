"""Masked-LM pretraining (BERT, run_mlm): the masks, parity of every kind of layout with one
process under the same masks, resume, and the model it saves.

The masks are a function of (seed, epoch, sample id) (raylm.models.objectives.mask_tokens),
so the single-process reference (tests/reference.py) draws the same masks for the same
samples and holds the layouts to the same tolerances as causal LM's.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForMaskedLM, pipeline

from raylm import TrainConfig, train
from raylm.cli.main import main
from raylm.data.reader import IGNORE_INDEX
from raylm.models.objectives import Masking, mask_tokens
from tests.numerics import assert_steps_match, assert_weights_match
from tests.reference import reference_fixture

STEPS = 3
GLOBAL_BATCH = 8
MICRO = 2
TINY_BERT = ("num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64,"
             "max_position_embeddings=64,hidden_dropout_prob=0.0,"
             "attention_probs_dropout_prob=0.0")


def wordpiece_tokenizer(corpus, cache_root) -> str:
    """An uncased WordPiece tokenizer trained on the corpus, once per session."""
    from raylm.data.tokenizer_train import train_tokenizer

    out = os.path.join(cache_root, "wordpiece-uncased")
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        train_tokenizer(sorted(str(p) for p in corpus.iterdir()), out, type="wordpiece",
                        vocab_size=1000, lowercase=True)
    return out


def mlm_config(out, corpus, cache_root, model="bert", **kw) -> TrainConfig:
    dp = kw.get("dp", 1)
    base = dict(model_type=model, config_overrides=TINY_BERT,
                tokenizer_name=wordpiece_tokenizer(corpus, cache_root),
                train_file=[str(corpus)], block_size=32, data_cache_dir=cache_root,
                output_dir=str(out), max_steps=STEPS, logging_steps=1, save_steps=1000,
                disable_tqdm=True, learning_rate=1e-3, warmup_steps=1,
                per_device_train_batch_size=MICRO, cpus_per_worker=0.5,
                gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * dp))
    base.update(kw)
    return TrainConfig(**base)


reference = reference_fixture("mlm", mlm_config, GLOBAL_BATCH, STEPS)


def masking(**kw) -> Masking:
    base = dict(seed=42, probability=0.15, mask_token_id=4, special_ids=(0, 1, 2, 3, 4),
                vocab_size=1000)
    base.update(kw)
    return Masking(**base)


def test_masks_are_dynamic_masking_drawn_per_sample():
    """About 15% of the non-special tokens are selected; of those 80% become [MASK], 10% a
    random token, 10% stay (HF's DataCollatorForLanguageModeling's split); special tokens
    and unlabelled positions never; a sample's masks depend on (seed, epoch, sample id)
    only, not on the batch it is in."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (2000, 64), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    labels = ids.clone()
    labels[:5, 40:] = IGNORE_INDEX  # padding of line-by-line samples
    sample_ids = torch.arange(2000)
    sample_ids[7] = -1  # a filler row
    m = masking()
    masked, target = mask_tokens(ids, labels, sample_ids, m, epoch=0)
    chosen = target != IGNORE_INDEX
    assert torch.equal(target[chosen], ids[chosen])  # labels are the originals
    assert not chosen[:, 0].any() and not chosen[:, -1].any()  # specials never
    assert not chosen[:5, 40:].any() and not chosen[7].any()  # unlabelled, fillers
    share = chosen.sum().item() / ((labels != IGNORE_INDEX) & (ids > 4)).sum().item()
    assert abs(share - 0.15) < 0.005, share  # ~19,000 selected: 0.15 +- 0.0026 (1 sigma)
    n = chosen.sum().item()
    to_mask = (masked == 4) & chosen
    kept = (masked == ids) & chosen
    randomized = chosen & ~to_mask & (masked != ids)
    assert abs(to_mask.sum().item() / n - 0.8) < 0.015
    # A random replacement equals the original 1 time in 1000: "kept" holds those too.
    assert abs(kept.sum().item() / n - 0.1) < 0.01
    assert abs(randomized.sum().item() / n - 0.1) < 0.01
    assert torch.equal(masked[~chosen], ids[~chosen])  # the rest untouched

    # The same sample in another batch, at another row: the same masks.
    order = torch.randperm(2000, generator=g)[:50]
    again, again_target = mask_tokens(ids[order], labels[order], sample_ids[order], m, 0)
    assert torch.equal(again, masked[order]) and torch.equal(again_target, target[order])
    # Another epoch, another seed, or evaluation: other masks (evaluation's are fixed).
    for other in (mask_tokens(ids, labels, sample_ids, m, 1),
                  mask_tokens(ids, labels, sample_ids, masking(seed=43), 0),
                  mask_tokens(ids, labels, sample_ids, m, None)):
        assert (other[1] != target).float().mean() > 0.1
    assert torch.equal(mask_tokens(ids, labels, sample_ids, m, None)[1],
                       mask_tokens(ids, labels, sample_ids, m, None)[1])


def test_whole_word_masking_selects_words():
    """With continuation ids (WordPiece's '##' tokens) a word's tokens are selected
    together, and about 15% of words are."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 1000, (500, 64), generator=g)
    continuation = tuple(range(500, 1000))  # ids 500.. continue the word before them
    masked, target = mask_tokens(ids, ids.clone(), torch.arange(500),
                                 masking(continuation_ids=continuation), epoch=0)
    chosen = target != IGNORE_INDEX
    starts = ids < 500
    words = picked = 0
    for row in range(500):
        bounds = [i for i in range(64) if starts[row, i] or i == 0] + [64]
        for a, b in zip(bounds, bounds[1:]):
            span = chosen[row, a:b]
            assert span.all() or not span.any(), (row, a, b)  # all of a word, or none
            words, picked = words + 1, picked + int(span.all())
    assert abs(picked / words - 0.15) < 0.01, picked / words


def assert_mlm_parity(result, ref, steps=STEPS):
    assert_steps_match(result.history, ref, steps, label=result.output_dir)
    assert result.history[-1]["loss"] < result.history[0]["loss"]  # it trained
    config = AutoConfig.from_pretrained(result.output_dir)
    assert config.architectures == ["BertForMaskedLM"] and not config.is_decoder
    saved = AutoModelForMaskedLM.from_pretrained(result.output_dir).state_dict()
    assert_weights_match(saved, ref.state, ref.exact, ref.lr_sum, label=result.output_dir,
                         allowance=ref.allowance)


# (dp, pp, tp, zero stage); plain dp=2 and pp=2 run in the resume test below.
RUNS = [(1, 1, 2, 0), (2, 1, 1, 2)]


# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_mlm_layout_matches_single_process": {"dp2-pp1-tp1-zero2"},
}


@pytest.mark.parametrize("dp,pp,tp,stage", RUNS,
                         ids=[f"dp{d}-pp{p}-tp{t}" + (f"-zero{z}" if z else "")
                              for d, p, t, z in RUNS])
def test_mlm_layout_matches_single_process(dp, pp, tp, stage, reference, ray_cluster,
                                           corpus_dir, cache_root, tmp_path):
    result = train(mlm_config(tmp_path / "out", corpus_dir, cache_root, dp=dp, pp=pp, tp=tp,
                              num_workers=dp * pp * tp, zero_stage=stage))
    assert result.metrics["world_size"] == dp * pp * tp
    assert_mlm_parity(result, reference("bert"))
    # Throughput counts the tokens read (8 samples of 32), not the ~15% predicted.
    assert all(h["throughput_tokens"] == GLOBAL_BATCH * 32 for h in result.history)
    assert all(h["tokens"] < GLOBAL_BATCH * 32 * 0.3 for h in result.history)


def test_mlm_pipeline_then_resume_under_data_parallel(reference, ray_cluster, corpus_dir,
                                                      cache_root, tmp_path):
    """pp=2 reproduces one process; its step-1 checkpoint resumes under dp=2 with the
    uninterrupted run's losses (the resumed steps draw the same masks), and the saved
    model answers a fill-mask pipeline."""
    ref = reference("bert")
    piped = train(mlm_config(tmp_path / "pp2", corpus_dir, cache_root, pp=2, num_workers=2,
                             save_steps=1))
    assert_mlm_parity(piped, ref)
    ckpt = os.path.join(piped.output_dir, "checkpoints", "step-00000001")
    resumed = train(mlm_config(tmp_path / "dp2", corpus_dir, cache_root, dp=2, num_workers=2,
                               resume_from_checkpoint=ckpt))
    assert [h["step"] for h in resumed.history] == list(range(2, STEPS + 1))
    np.testing.assert_allclose([h["loss"] for h in resumed.history], ref.losses[1:],
                               rtol=1e-5)

    fill = pipeline("fill-mask", model=resumed.output_dir, tokenizer=resumed.output_dir)
    guesses = fill("to be or not to [MASK] .")
    assert len(guesses) == 5 and all(g["token_str"] and 0 < g["score"] < 1 for g in guesses)
    assert sorted(g["score"] for g in guesses)[::-1] == [g["score"] for g in guesses]


@pytest.mark.slow
def test_bert_tutorial_end_to_end(ray_cluster, corpus_dir, cache_root, tmp_path):
    """The tutorial, by its commands: train an uncased WordPiece tokenizer, pretrain a BERT
    from scratch with masked LM on two plays (dp=2), fine-tune it on a third line by line
    (pp=2, padded samples), and fill a mask with the result."""
    plays = [str(corpus_dir / n) for n in ("macbeth.txt", "julius_caesar.txt")]
    other = str(corpus_dir / "comedy_of_errors.txt")
    tok, pre, tuned = (str(tmp_path / n) for n in ("tok", "pre", "tuned"))
    common = ["--data_cache_dir", cache_root, "--disable_tqdm", "--num_workers", "2",
              "--cpus_per_worker", "0.5", "--max_seq_length", "32", "--logging_steps", "1"]
    assert main(["tokenizer", "train", *plays, "-o", tok, "--type", "wordpiece",
                 "--vocab_size", "1000", "--lowercase"]) == 0
    assert main(["train", "--model_type", "bert", "--config_overrides", TINY_BERT,
                 "--tokenizer_name", tok, "--train_file", *plays, "--output_dir", pre,
                 "--max_steps", "4", "--learning_rate", "1e-3", *common]) == 0
    assert main(["train", "--model_name_or_path", pre, "--train_file", other, "--line_by_line",
                 "--pad_to_max_length", "--output_dir", tuned, "--pp", "2", "--max_steps", "3",
                 "--gradient_accumulation_steps", "2",
                 "--learning_rate", "1e-4", *common]) == 0

    for out in (pre, tuned):
        results = json.load(open(os.path.join(out, "all_results.json")))
        assert results["global_step"] in (3, 4) and np.isfinite(results["eval_loss"])
        assert np.isclose(results["perplexity"], np.exp(results["eval_loss"]), rtol=1e-4)
    # Fine-tuning started from the pretrained weights and moved them a little.
    a = AutoModelForMaskedLM.from_pretrained(pre).state_dict()
    b = AutoModelForMaskedLM.from_pretrained(tuned).state_dict()
    emb = "bert.embeddings.word_embeddings.weight"
    change = (b[emb] - a[emb]).norm() / a[emb].norm()
    assert 0 < change < 0.05, change
    fill = pipeline("fill-mask", model=tuned, tokenizer=tuned)
    guesses = fill("WHAT IS THE [MASK] ?")  # the saved tokenizer is uncased
    assert len(guesses) == 5 and guesses[0]["sequence"] == guesses[0]["sequence"].lower()
