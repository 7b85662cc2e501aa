"""The user's path: `raylm train` on defaults, Hugging Face out and back in, fine-tune,
evaluate only, run files, cache reuse."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raylm.cli.main import main
from raylm.data.reader import BlockReader
from raylm.data.sampler import GlobalBatchSampler
from raylm.runtime.input_checks import check_inputs
from raylm.runtime.prepare import prepare_data
from raylm.config import TrainConfig
from tests.conftest import CPUS


def records(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def default_run(ray_cluster, cache_root, tmp_path_factory):
    """`raylm train` with the built-in defaults (model, tokenizer, corpus), cut short."""
    out = tmp_path_factory.mktemp("default") / "raylm-output"
    rc = main(["train", "--max_steps", "4", "--logging_steps", "2", "--output_dir", str(out),
               "--data_cache_dir", cache_root, "--disable_tqdm"])
    assert rc == 0
    return out


@pytest.mark.slow
def test_default_run_writes_a_model_that_transformers_loads(default_run):
    out = str(default_run)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl",
                 "all_results.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-00000004"))
    recs = records(out)
    assert [r["step"] for r in recs if "loss" in r] == [2, 4]
    assert {"step", "loss", "learning_rate", "tokens_per_second"} <= set(recs[0])
    ev = [r for r in recs if "eval_loss" in r]
    assert len(ev) == 1 and ev[0]["perplexity"] == pytest.approx(math.exp(ev[0]["eval_loss"]))

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "gpt2" and model.config.vocab_size == len(tok)
    ids = tok("To be, or not to be", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape[1] == ids.shape[1] + 8
    assert isinstance(tok.decode(gen[0]), str)


@pytest.fixture
def pretrained_dir(tmp_path):
    """A model directory written by the test itself: tiny GPT-2, no dropout, saved with
    save_pretrained together with the built-in tokenizer."""
    from transformers import GPT2Config

    from raylm.data.sources import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir())
    config = GPT2Config(vocab_size=len(tok), n_layer=2, n_embd=32, n_head=2, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(123)
    path = tmp_path / "pretrained"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_fine_tune_loads_the_pretrained_weights_and_eval_only_scores_them(
        pretrained_dir, ray_cluster, cache_root, tmp_path):
    """--model_name_or_path starts from the saved weights: step 1's loss is the saved
    model's own loss on step 1's samples. --do_eval alone reports its perplexity."""
    pretrained = pretrained_dir
    out = tmp_path / "finetuned"
    args = ["train", "--model_name_or_path", pretrained, "--max_steps", "2",
            "--logging_steps", "1", "--output_dir", str(out), "--data_cache_dir", cache_root,
            "--num_workers", "2", "--cpus_per_worker", str(CPUS),
            "--per_device_train_batch_size", "2",
            "--block_size", "64", "--disable_tqdm", "--do_eval", "false"]
    assert main(args) == 0

    # Expected first loss: the pretrained model on the first global batch.
    cfg = TrainConfig(model_name_or_path=pretrained, block_size=64, data_cache_dir=cache_root,
                      output_dir=str(out), per_device_train_batch_size=2)
    inputs = check_inputs(cfg, check_output_dir=False)
    data = prepare_data(cfg, inputs)
    ids = GlobalBatchSampler(data.train_ids, 4, cfg.seed).global_batch(0)
    b = BlockReader(data.train).read(ids)
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    with torch.no_grad():
        expect = model(input_ids=b["input_ids"], labels=b["labels"]).loss.item()
    first = [r for r in records(out) if "loss" in r][0]
    assert first["step"] == 1 and first["loss"] == pytest.approx(expect, rel=1e-5)

    # Evaluate only: the fine-tuned model on the held-out split, no training.
    eval_out = tmp_path / "eval"
    assert main(["train", "--do_eval", "--model_name_or_path", str(out), "--block_size", "64",
                 "--data_cache_dir", cache_root, "--output_dir", str(eval_out),
                 "--num_workers", "2", "--cpus_per_worker", str(CPUS)]) == 0
    with open(eval_out / "eval_results.json") as f:
        res = json.load(f)
    assert res["perplexity"] == pytest.approx(math.exp(res["eval_loss"]))
    with open(eval_out / "all_results.json") as f:  # (as the Trainer's save_metrics)
        both = json.load(f)
    assert both["eval_loss"] == res["eval_loss"] and both["startup_s"]["engines"] > 0
    tuned = AutoModelForCausalLM.from_pretrained(str(out))
    reader = BlockReader(data.train)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for chunk in np.array_split(data.eval_ids, max(1, len(data.eval_ids) // 8)):
            eb = reader.read(chunk)
            logits = tuned(input_ids=eb["input_ids"]).logits[:, :-1]
            labels = eb["labels"][:, 1:]
            loss_sum += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum").item()
            count += labels.numel()
    assert res["eval_loss"] == pytest.approx(loss_sum / count, rel=1e-5)
    assert not os.path.exists(eval_out / "checkpoints")


def test_run_file_with_flags_winning(ray_cluster, cache_root, tmp_path, caplog):
    """A YAML run file supplies settings; flags on the command line win. A second run
    on the same data, tokenizer and block size reuses the tokenized cache."""
    caplog.set_level("INFO", logger="raylm")
    run = tmp_path / "run.yaml"
    run.write_text("max_steps: 50\nlearning_rate: 2e-3\nlogging_steps: 1\n"
                   "per_device_train_batch_size: 2\nnum_workers: 1\ndo_eval: false\n"
                   "disable_tqdm: true\n")
    assert main(["train", str(run), "--max_steps", "1", "--output_dir", str(tmp_path / "first"),
                 "--data_cache_dir", cache_root]) == 0
    caplog.clear()
    out = tmp_path / "out"
    assert main(["train", str(run), "--max_steps", "2", "--output_dir", str(out),
                 "--data_cache_dir", cache_root]) == 0
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 2]
    with open(out / "raylm_run.json") as f:
        assert json.load(f)["learning_rate"] == 2e-3
    assert "samples of 128 tokens (cached)" in caplog.text


def test_tokenize_command_builds_the_cache_train_reuses(ray_cluster, corpus_dir, tmp_path,
                                                        capsys):
    cache = str(tmp_path / "cache")
    args = ["tokenize", "--train_file", str(corpus_dir), "--block_size", "48",
            "--data_cache_dir", cache]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "raylm: train:" in first and "(tokenized)" in first
    assert main(args) == 0
    assert "(reused)" in capsys.readouterr().out


def test_tokenizer_train_command(tmp_path, corpus_dir, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--type", "wordpiece", "--vocab_size", "600",
                 str(corpus_dir / "macbeth.txt"), "-o", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) <= 600
    ids = tok("Fair is foul, and foul is fair")["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
