"""Hugging Face Trainer flags as run_clm users type them: hyphen spellings and old names,
one line for a flag raylm does not take, --warmup_ratio, --lr_scheduler_kwargs,
--data_seed, the logging / evaluation / save strategies, --report_to tensorboard and the
logged grad_norm and mfu, raylm plot (one small real run), and --load_best_model_at_end,
--early_stopping_patience and --save_only_model (two more)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from raylm import ConfigError, TrainConfig
from raylm.cli.args import config_from_namespace, load_run_file
from raylm.cli.main import build_parser, main
from raylm.data.sampler import GlobalBatchSampler
from raylm.runtime.schedule import make_scheduler
from tests.conftest import REPO, SHAKESPEARE, TINY_GPT2
from tests.dashboards import tensorboard_scalars


def parse(*args):
    ns = build_parser().parse_args(["train", *args])
    return config_from_namespace(ns, {})


def test_hyphen_spellings_and_the_old_evaluation_strategy_name():
    cfg = parse("--per-device-train-batch-size", "3", "--learning-rate", "0.01",
                "--evaluation_strategy", "epoch", "--save-strategy", "no",
                "--do-eval", "false", "--warmup-ratio", "0.1")
    assert (cfg.per_device_train_batch_size, cfg.learning_rate) == (3, 0.01)
    assert (cfg.eval_strategy, cfg.save_strategy, cfg.do_eval) == ("epoch", "no", False)
    assert cfg.warmup_ratio == 0.1
    assert parse("--eval-strategy", "steps", "--eval_steps", "5").eval_strategy == "steps"
    assert parse("--streaming").streaming is True  # (HF's flag: tokenize while training)
    assert parse("--streaming", "false").streaming is False


@pytest.mark.parametrize("args, says", [
    (["--deepspeed", "ds_config.json"], "--deepspeed: raylm shards data-parallel state "
                                        "itself: use --zero_stage 1, 2 or 3"),
    (["--fsdp", "full_shard"], "--fsdp: raylm shards data-parallel state itself"),
    (["--push-to-hub"], "--push_to_hub: raylm does not upload"),
    (["--fp16_opt_level", "O1"], "--fp16_opt_level: raylm's --fp16 is torch.autocast"),
    (["--local_rank=0"], "--local_rank: raylm starts one Ray actor per rank itself"),
])
def test_a_trainer_flag_raylm_does_not_take_is_one_line_saying_what_instead(
        args, says, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--max_steps", "2", *args])
    assert e.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"raylm: error: {says}"), line


def test_run_file_keys_take_old_names_and_refuse_foreign_ones(tmp_path):
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"evaluation_strategy": "epoch",
                                "lr_scheduler_kwargs": {"num_cycles": 2}}))
    cfg = config_from_namespace(build_parser().parse_args(["train"]), load_run_file(str(good)))
    assert cfg.eval_strategy == "epoch" and json.loads(cfg.lr_scheduler_kwargs) == \
        {"num_cycles": 2}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"deepspeed": "ds.json"}))
    with pytest.raises(ConfigError, match="deepspeed: raylm shards"):
        load_run_file(str(bad))


def test_the_example_run_file_is_a_run_whose_inputs_check(tmp_path, monkeypatch):
    """examples/run.yaml, as the docs run it: from a directory holding corpus/, with a
    flag on the line that wins; its model, data and numbers pass the checks made before
    Ray starts."""
    from raylm.runtime.input_checks import check_inputs

    shutil.copytree(SHAKESPEARE, tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    ns = build_parser().parse_args(["train", str(REPO / "examples" / "run.yaml"),
                                    "--max_steps", "10"])
    cfg = config_from_namespace(ns, load_run_file(ns.run_file))
    assert cfg.max_steps == 10 and cfg.num_workers == 2 and cfg.train_file == ["corpus/"]
    inputs = check_inputs(cfg)
    assert inputs.block_size == 64 and len(inputs.train_files) == 36


def lrs(settings: dict, total: int) -> list:
    """The learning rate of each of ``total`` steps under raylm's schedule."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = make_scheduler(opt, settings, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_ratio_and_scheduler_kwargs_shape_the_schedule():
    base = {"lr_scheduler_type": "linear", "warmup_steps": 0, "warmup_ratio": 0.0}
    # 0.25 of 8 steps: 2 warm-up steps (0, 1/2), then linear decay from the peak
    assert lrs({**base, "warmup_ratio": 0.25}, 8)[:3] == [0.0, 0.5, 1.0]
    assert lrs(base, 8)[0] == 1.0  # no warm-up
    # --warmup_steps wins over the ratio, as in TrainingArguments
    assert lrs({**base, "warmup_steps": 4, "warmup_ratio": 0.25}, 8)[:3] == [0.0, 0.25, 0.5]
    # cosine with two hard restarts: back at the peak half-way, not with one cycle
    restarts = {**base, "lr_scheduler_type": "cosine_with_restarts"}
    two = lrs({**restarts, "lr_scheduler_kwargs": json.dumps({"num_cycles": 2})}, 10)
    one = lrs(restarts, 10)
    assert two[5] == pytest.approx(1.0) and one[5] < 0.6


@pytest.mark.parametrize("args, message", [
    (["--lr_scheduler_kwargs", "{num_cycles: 2}"], "--lr_scheduler_kwargs must be a JSON "
                                                   "object"),
    (["--lr_scheduler_kwargs", '{"num_cycle": 2}', "--lr_scheduler_type",
      "cosine_with_restarts"], "does not suit --lr_scheduler_type cosine_with_restarts"),
    (["--warmup_ratio", "1.5"], "--warmup_ratio must be in [0, 1]"),
    (["--eval_strategy", "steps"], "--eval_strategy steps needs --eval_steps N"),
])
def test_bad_schedule_or_strategy_is_one_line_before_any_actor(args, message, tmp_path,
                                                               capsys):
    rc = main(["train", "--output_dir", str(tmp_path / "out"), "--disable_tqdm", *args])
    err = capsys.readouterr().err
    assert rc == 2
    [line] = [line for line in err.splitlines() if "error:" in line]
    assert message in line, line


PEAK_TFLOPS = 0.05


@pytest.fixture(scope="module")
def epoch_run(ray_cluster, cache_root, tmp_path_factory):
    """Three epochs of a 2-step-per-epoch corpus (2 ranks), strategies at epoch ends, a
    warm-up ratio and a data seed of its own, reported to TensorBoard with a peak for
    the mfu, on the first 16 training samples and the first 3 of each of two validation
    files."""
    root = tmp_path_factory.mktemp("epochs")
    text = (SHAKESPEARE / "macbeth.txt").read_text()[:6000]
    (root / "train.txt").write_text(text[:4000])
    (root / "valid.txt").write_text(text[4000:])
    (root / "caesar.txt").write_text((SHAKESPEARE / "julius_caesar.txt").read_text()[:3000])
    out = root / "out"
    warned = _Warnings()
    logging.getLogger("raylm").addHandler(warned)
    try:
        rc = main(["train", "--model_type", "gpt2", "--config_overrides", TINY_GPT2,
                   "--train_file", str(root / "train.txt"),
                   "--validation_file", str(root / "valid.txt"), str(root / "caesar.txt"),
                   "--block_size", "32",
                   "--per_device_train_batch_size", "4", "--num_workers", "2",
                   "--cpus_per_worker", "0.5", "--num_train_epochs", "3",
                   "--logging_strategy", "epoch", "--eval_strategy", "epoch",
                   "--save-strategy", "epoch", "--warmup_ratio", "0.5", "--data_seed", "7",
                   "--log_sample_ids", "--data_cache_dir", cache_root,
                   "--output_dir", str(out),
                   "--report_to", "tensorboard", "--peak_tflops", str(PEAK_TFLOPS),
                   "--max_train_samples", "16", "--max_eval_samples", "3", "--disable_tqdm"])
    finally:
        logging.getLogger("raylm").removeHandler(warned)
    assert rc == 0
    with open(out / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    with open(out / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    return out, recs, samples, warned.lines


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_too_little_data_is_warned_of_with_the_numbers_and_the_flag(epoch_run):
    """16 training samples for a global batch of 8, 3 of each validation file."""
    *_, warned = epoch_run
    assert ("training data: 16 sample(s), under 3 global batches of 8: give more data, "
            "or lower --block_size or --per_device_train_batch_size") in warned, warned
    assert any(w.startswith("evaluation on 6 sample(s)") for w in warned), warned
    assert not any("data-parallel rank(s) with none" in w for w in warned), warned


def test_a_rank_without_samples_and_a_file_without_a_block_are_warned_of():
    """5 samples, a global batch of 4 on 4 ranks: the last step's 1 sample leaves 3 ranks
    idle; one of two files too short for a block gave none (as group_texts drops it)."""
    from raylm.data.tokenized import TokenizedDataset
    from raylm.runtime.inputs import Data
    from raylm.runtime.prepare import degenerate

    train = TokenizedDataset(cache_dir="", num_samples=5, block_size=64, line_by_line=False,
                             pad_token_id=0, shard_files=[], shard_offsets=[],
                             samples_per_file=[5, 0])
    data = Data(train=train, eval=None, train_ids=np.arange(5))
    warned = degenerate(TrainConfig(), data, global_batch=4, dp=4)
    assert warned[1] == ("a step of 1 sample(s) leaves 3 of the 4 data-parallel rank(s) "
                         "with none: lower --num_workers or --dp")
    assert warned[2].startswith("1 of 2 training file(s) gave no sample: each holds fewer "
                                "than --block_size 64 tokens"), warned
    assert degenerate(TrainConfig(), Data(train=train, eval=None, train_ids=np.arange(12)),
                      global_batch=4, dp=4)[-1].startswith("1 of 2 training file(s)")
    # A run that stops before the epoch's short last step never has idle ranks.
    assert not any("with none" in w for w in degenerate(TrainConfig(max_steps=1), data,
                                                        global_batch=4, dp=4))


@pytest.mark.slow
def test_epoch_strategies_log_evaluate_and_save_at_epoch_ends(epoch_run):
    out, recs, samples, _ = epoch_run
    steps = len(samples)
    per_epoch = steps // 3
    assert steps == 3 * per_epoch and per_epoch >= 2
    ends = [per_epoch * k for k in (1, 2, 3)]
    assert [r["step"] for r in recs if "loss" in r] == ends
    assert [r["step"] for r in recs if "eval_loss" in r] == ends  # the last is the final one
    assert sorted(os.listdir(out / "checkpoints")) == [f"step-{s:08d}" for s in ends]
    # --warmup_ratio 0.5: the learning rate climbs over ceil(steps / 2) steps, then falls
    # linearly to 0 (each record: the rate step s trained at, the schedule's (s - 1)th)
    peak, warm = 5e-4, int(np.ceil(steps * 0.5))
    lr = {r["step"]: r["learning_rate"] for r in recs if "loss" in r}
    assert lr[ends[0]] == pytest.approx(peak * (ends[0] - 1) / warm)
    assert lr[ends[1]] == pytest.approx(peak * (steps - ends[1] + 1) / (steps - warm))


def test_data_seed_orders_the_samples_and_not_the_model(epoch_run):
    _, _, samples, _ = epoch_run
    trained = [sorted(i for rank in s["ranks"] for i in rank) for s in samples]
    n = sum(len(t) for t in trained[:len(trained) // 3])
    batch = len(trained[0])
    ours = GlobalBatchSampler(np.arange(n), batch, 7)
    default = GlobalBatchSampler(np.arange(n), batch, 42)
    assert trained == [sorted(ours.global_batch(k).tolist()) for k in range(len(trained))]
    assert trained != [sorted(default.global_batch(k).tolist()) for k in range(len(trained))]


def test_logged_steps_carry_grad_norm_step_time_and_mfu_and_reach_tensorboard(epoch_run):
    out, recs, _, _ = epoch_run
    train_recs = [r for r in recs if "loss" in r]
    config = json.loads((out / "config.json").read_text())
    # PaLM's model FLOPs per token, from the saved model's own shapes: 6 per weight of
    # every matrix it multiplies by (the blocks' and the output head's, which GPT-2 ties
    # to the token embedding; not the position table), and 12 x layers x width x
    # sequence for attention.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    matrices = sum(p.numel() for n, p in model.named_parameters()
                   if p.ndim >= 2 and "wpe" not in n)
    flops = 6 * matrices + 12 * config["n_layer"] * config["n_embd"] * 32
    for r in train_recs:
        assert r["grad_norm"] > 0 and r["step_time_s"] > 0 and r["world_size"] == 2
        assert r["mfu"] == pytest.approx(r["tokens_per_second"] * flops
                                         / (PEAK_TFLOPS * 1e12 * 2), rel=1e-6)
    shown = tensorboard_scalars(str(out / "runs"))
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "mfu"):
        assert shown[f"train/{key}"] == pytest.approx({r["step"]: r[key] for r in train_recs})
    evals = [r for r in recs if "eval_loss" in r]
    assert shown["eval/loss"] == pytest.approx({r["step"]: r["eval_loss"] for r in evals})
    assert shown["eval/perplexity"] == pytest.approx({r["step"]: r["perplexity"]
                                                      for r in evals}, rel=1e-5)


def test_raylm_plot_writes_the_png(epoch_run, tmp_path, capsys):
    out, _, _, _ = epoch_run
    png = tmp_path / "curves.png"
    assert main(["plot", str(out), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["plot", str(tmp_path)]) == 2  # no metrics.jsonl: one line
    assert "no metrics.jsonl here" in capsys.readouterr().err


def test_raylm_plot_marks_a_lone_step_and_says_it_is_too_few(tmp_path, caplog):
    """A run that logged one training step: its point is drawn (marked) and a warning
    says why there is no curve."""
    import logging

    from raylm.cli.plot import draw

    record = {"step": 1, "loss": 5.0, "learning_rate": 1e-3, "tokens_per_second": 100.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    with caplog.at_level(logging.WARNING, logger="raylm"):
        assert main(["plot", str(tmp_path)]) == 0
    assert "1 training step(s) logged, too few for a curve" in caplog.text
    assert (tmp_path / "metrics.png").stat().st_size > 0
    fig = draw([record], "one step")
    drawn = [line for ax in fig.axes for line in ax.lines if len(line.get_xdata()) == 1]
    assert len(drawn) == 3 and all(line.get_marker() == "o" for line in drawn)
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.fixture(scope="module")
def best_runs(ray_cluster, cache_root, tmp_path_factory):
    """The same run twice (2 ranks), evaluated and saved every 2 steps, ranking the
    checkpoints by the highest evaluation loss (--greater_is_better true: as the loss
    falls, the first evaluation is the best, and the next ones do not improve on it),
    with a patience of 2: once with whole checkpoints, once with --save_only_model."""
    root = tmp_path_factory.mktemp("best")
    text = (SHAKESPEARE / "macbeth.txt").read_text()[:12000]
    (root / "train.txt").write_text(text[:10000])
    (root / "valid.txt").write_text(text[10000:])
    runs = {}
    for name, extra in (("whole", []), ("model_only", ["--save_only_model"])):
        out = root / name
        rc = main(["train", "--model_type", "gpt2", "--config_overrides", TINY_GPT2,
                   "--train_file", str(root / "train.txt"),
                   "--validation_file", str(root / "valid.txt"), "--block_size", "32",
                   "--per_device_train_batch_size", "4", "--num_workers", "2",
                   "--cpus_per_worker", "0.5", "--max_steps", "20", "--learning_rate", "3e-3",
                   "--eval_strategy", "steps", "--eval_steps", "2", "--save_steps", "2",
                   "--save_total_limit", "1", "--load_best_model_at_end",
                   "--metric_for_best_model", "loss", "--greater_is_better", "true",
                   "--early_stopping_patience", "2", *extra,
                   "--data_cache_dir", cache_root, "--output_dir", str(out), "--disable_tqdm"])
        assert rc == 0
        runs[name] = out
    return runs


def weights(directory) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.slow
def test_early_stopping_stops_and_the_best_checkpoint_is_the_model_saved(best_runs):
    for name, out in best_runs.items():
        results = json.loads((out / "all_results.json").read_text())
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        evals = {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r}
        # The loss falls, so evaluations 2 and 3 do not beat the first: stop at step 6
        # (no second evaluation of step 6 at the end).
        assert list(evals) == [2, 4, 6] and evals[2] > evals[4] > evals[6], evals
        assert results["global_step"] == 6 and results["stopped_early"] is True
        assert (results["best_global_step"], results["best_metric"]) == (2, evals[2])
        # --save_total_limit 1 keeps the newest checkpoint and, besides, the best.
        assert sorted(os.listdir(out / "checkpoints")) == ["step-00000002", "step-00000006"]
        assert results["best_model_checkpoint"] == str(out / "checkpoints" / "step-00000002")
    # The model-only checkpoints are Hugging Face model directories: step 2's is the
    # model both runs saved at the end (the whole-state run loaded step 2's checkpoint
    # into its ranks and saved from there).
    step2 = best_runs["model_only"] / "checkpoints" / "step-00000002"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(step2))
    best = weights(step2)
    for out in best_runs.values():
        final = weights(out)
        assert final.keys() == best.keys()
        for k in best:
            torch.testing.assert_close(final[k], best[k], rtol=0, atol=1e-6)
    last = weights(best_runs["model_only"] / "checkpoints" / "step-00000006")
    assert any(not torch.equal(last[k], best[k]) for k in best)


def test_a_model_only_checkpoint_is_not_resumed(best_runs, capsys):
    out = best_runs["model_only"]
    state = json.loads((out / "checkpoints" / "step-00000006" / "trainer_state.json")
                       .read_text())
    assert state["model_only"] is True and state["evaluations"][0] == [2, pytest.approx(
        state["best_metric"])]
    rc = main(["train", "--resume_from_checkpoint", str(out / "checkpoints" / "step-00000006"),
               "--output_dir", str(out.parent / "again"), "--disable_tqdm"])
    assert rc == 2
    assert "holds the model only (--save_only_model)" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--load_best_model_at_end"], "--load_best_model_at_end needs evaluations during "
                                   "training"),
    (["--load_best_model_at_end", "--eval_steps", "5", "--save_strategy", "epoch"],
     "needs --save_strategy equal to --eval_strategy (they are epoch and steps)"),
    (["--load_best_model_at_end", "--eval_steps", "4", "--save_steps", "6"],
     "needs --save_steps (6) to be a multiple of --eval_steps (4)"),
    (["--early_stopping_patience", "0", "--eval_steps", "5"],
     "--early_stopping_patience must be >= 1"),
    (["--metric_for_best_model", "accuracy"],
     "--metric_for_best_model accuracy: the evaluation reports loss, perplexity"),
])
def test_best_model_flags_that_cannot_work_are_one_line(args, message, tmp_path, capsys):
    rc = main(["train", "--output_dir", str(tmp_path / "out"), "--disable_tqdm", *args])
    assert rc == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert message in line, line


def test_max_train_and_eval_samples_train_and_evaluate_on_the_first_n(epoch_run):
    out, recs, samples, _ = epoch_run
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_samples"] == 16
    per_epoch = len(samples) // 3
    for epoch in range(3):
        ids = [i for s in samples[epoch * per_epoch:(epoch + 1) * per_epoch]
               for rank in s["ranks"] for i in rank]
        assert sorted(ids) == list(range(16))  # each of the first 16 once an epoch
    assert {r["eval_samples"] for r in recs if "eval_loss" in r} == {6}  # 3 of each file


def test_several_validation_files_are_reported_each_and_together(epoch_run):
    out, recs, _, _ = epoch_run
    evals = [r for r in recs if "eval_loss" in r]
    for r in evals:
        # Full blocks of the same size: the overall loss is the plain mean of the two
        # sets' (3 samples each), and each perplexity is exp of its loss.
        assert r["eval_loss"] == pytest.approx((r["eval_valid_loss"]
                                                + r["eval_caesar_loss"]) / 2, rel=1e-9)
        assert r["eval_valid_loss"] != r["eval_caesar_loss"]
        for name in ("valid", "caesar"):
            assert r[f"eval_{name}_perplexity"] == pytest.approx(
                np.exp(r[f"eval_{name}_loss"]))
    results = json.loads((out / "all_results.json").read_text())
    assert results["eval_caesar_loss"] == evals[-1]["eval_caesar_loss"]
    shown = tensorboard_scalars(str(out / "runs"))
    assert shown["eval/caesar_loss"] == pytest.approx({r["step"]: r["eval_caesar_loss"]
                                                       for r in evals})
