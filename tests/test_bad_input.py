"""Bad input: one clear error line, exit status 2, no traceback, no actor started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylm import ConfigError, TrainConfig
from raylm.cli.main import main
from raylm.runtime.driver import Driver
from tests.conftest import TINY_GPT2


def run_cli(capsys, *args):
    rc = main(["train", *args])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    return rc, errors, err


def base_args(tmp_path, data, cache_root):
    return ["--model_type", "gpt2", "--config_overrides", TINY_GPT2, "--train_file", str(data),
            "--block_size", "32", "--data_cache_dir", cache_root, "--output_dir",
            str(tmp_path / "out"), "--max_steps", "2", "--disable_tqdm"]


def test_help_is_a_page_and_help_all_lists_every_flag(capsys):
    """`raylm train --help` shows the common flags and says where the rest are;
    `--help-all` names every TrainConfig field (a literal % in a help text once broke
    the help)."""
    import dataclasses

    from raylm.cli.args import BRIEF

    def help_of(flag):
        with pytest.raises(SystemExit) as stop:
            main(["train", flag])
        assert stop.value.code == 0
        return capsys.readouterr().out

    names = [f.name for f in dataclasses.fields(TrainConfig)]
    full = help_of("--help-all")
    assert [n for n in names if f"--{n}" not in full] == []
    brief = help_of("--help")
    assert [n for n in BRIEF if f"--{n} " not in brief and f"--{n}\n" not in brief] == []
    assert "--huge_pages" not in brief and "--peak_tflops" not in brief
    assert brief.rstrip().endswith(f"{len(names) - len(BRIEF)} more flags: --help-all, or "
                                   "the flags reference in the docs\n"
                                   "(docs/reference/flags.md).")
    assert len(brief.splitlines()) < len(full.splitlines()) / 2


def test_unknown_flag_is_one_line_from_the_real_command():
    proc = subprocess.run([sys.executable, "-m", "raylm.cli.main", "train", "--learning_rat",
                           "0.1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "raylm train: error: unrecognized arguments: --learning_rat (did you mean "
        "--learning_rate?) (see raylm train --help)"]
    assert proc.stdout == ""


def test_missing_train_file_from_the_real_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "raylm.cli.main", "train", "--train_file",
                           str(tmp_path / "nope.txt")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    [line] = [l for l in proc.stderr.splitlines() if "error" in l]
    assert line.startswith("raylm: error: --train_file") and "nope.txt" in line


@pytest.mark.parametrize("flags,message", [
    (["--tp", "3", "--num_workers", "2"], "--num_workers 2 cannot hold one pp=1 x tp=3 "
     "replica: give at least 3 workers, or lower --tp or --pp"),
    (["--pp", "2", "--num_workers", "3"], "dp=1 x tp=1 x pp=2 = 2 does not equal "
     "--num_workers 3: use a multiple of pp x tp = 2 workers"),
])
def test_a_layout_the_flags_cannot_hold_is_told_before_ray_starts(flags, message, tmp_path,
                                                                  corpus_dir, cache_root):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "raylm.cli.main", "train",
                           *base_args(tmp_path, corpus_dir, cache_root), *flags],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [l for l in proc.stderr.splitlines() if "error" in l] == [f"raylm: error: {message}"]
    assert "Ray cluster" not in proc.stderr and "ray" not in proc.stderr.replace("raylm", "")


@pytest.mark.parametrize("case", ["empty", "no_match", "bad_parquet", "not_utf8"])
def test_bad_train_files(case, tmp_path, capsys, cache_root):
    if case == "empty":
        data = tmp_path / "empty.txt"
        data.write_text("")
        expect = ["empty.txt", "empty"]
    elif case == "no_match":
        data = tmp_path / "*.jsonl"
        expect = ["matches no"]
    elif case == "bad_parquet":
        data = tmp_path / "broken.parquet"
        data.write_bytes(b"PAR1 this is not parquet at all")
        expect = ["broken.parquet"]
    else:
        data = tmp_path / "latin1.txt"
        data.write_bytes("good line\n".encode() * 3 + b"caf\xe9\n")
        expect = ["latin1.txt", "not valid UTF-8", "offset 33"]
    rc, errors, err = run_cli(capsys, *base_args(tmp_path, data, cache_root))
    assert rc == 2, err
    assert len(errors) == 1 and errors[0].startswith("raylm: error:"), err
    for word in expect:
        assert word in errors[0], errors[0]
    assert "Traceback" not in err


def test_block_size_past_model_positions(tmp_path, capsys, corpus_dir, cache_root):
    args = base_args(tmp_path, corpus_dir, cache_root)
    args[args.index("--block_size") + 1] = "65"
    rc, errors, _ = run_cli(capsys, *args)
    assert rc == 2
    assert errors == ["raylm: error: --block_size 65 is larger than the model's maximum "
                      "positions (64)"]


def test_config_override_unknown_key(tmp_path, capsys, corpus_dir, cache_root):
    args = base_args(tmp_path, corpus_dir, cache_root)
    args[args.index("--config_overrides") + 1] = "n_layer=2,n_wings=3"
    rc, errors, _ = run_cli(capsys, *args)
    assert rc == 2
    assert errors == ["raylm: error: --config_overrides: GPT2Config has no key 'n_wings'"]


@pytest.mark.parametrize("objective,message", [
    ("span", "--objective span: choose one of causal, seq2seq, mlm, span_corruption"),
    ("mlm", "--mlm: model type 'gpt2' has no masked-LM head in transformers (masked LM "
     "trains encoders: bert, roberta, distilbert, albert, ...); its objective is causal "
     "(drop --mlm)"),
    ("seq2seq", "--objective seq2seq does not train a decoder-only model ('gpt2'); its "
     "objective is causal (leave --objective unset)"),
])
def test_objective_the_model_cannot_train(objective, message, tmp_path, capsys, corpus_dir,
                                          cache_root):
    rc, errors, _ = run_cli(capsys, *base_args(tmp_path, corpus_dir, cache_root),
                            "--objective", objective)
    assert rc == 2
    assert errors == [f"raylm: error: {message}"]


TINY_BERT = ("num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,"
             "max_position_embeddings=64")


@pytest.mark.parametrize("extra,message", [
    # BERT's default objective is masked LM; the built-in (GPT-2 style) tokenizer has no
    # mask token.
    ((), "masked LM needs a tokenizer with a mask token, and {tok} has none: train one with "
         "`raylm tokenizer train --type wordpiece` and give it with --tokenizer_name"),
    (("--mlm", "--config_overrides", TINY_BERT + ",is_decoder=True"),
     "--mlm: the 'bert' config is built as a decoder (is_decoder=True: causal attention); "
     "masked LM attends both ways: drop is_decoder=True, or train it with --objective causal"),
    (("--mlm", "--objective", "causal"),
     "--mlm and --objective causal name two objectives: give one"),
    (("--mlm_probability", "1.5", "--tokenizer_name", "{wordpiece}"),
     "--mlm_probability must be between 0 and 1 (got 1.5)"),
    (("--whole_word_masking", "--objective", "causal"),
     "--whole_word_masking applies to masked LM, not to the causal objective"),
])
def test_masked_lm_bad_input(extra, message, tmp_path, capsys, corpus_dir, cache_root):
    from raylm.data.sources import builtin_tokenizer_dir
    from raylm.data.tokenizer_train import train_tokenizer

    wordpiece = str(tmp_path / "wp")
    if "{wordpiece}" in extra:
        train_tokenizer([str(corpus_dir / "macbeth.txt")], wordpiece, type="wordpiece",
                        vocab_size=300)
    args = base_args(tmp_path, corpus_dir, cache_root)
    args[args.index("--model_type") + 1] = "bert"
    args[args.index("--config_overrides") + 1] = TINY_BERT
    extra = [a.replace("{wordpiece}", wordpiece) for a in extra]
    rc, errors, _ = run_cli(capsys, *args, *extra)
    assert rc == 2
    assert errors == ["raylm: error: " + message.format(tok=builtin_tokenizer_dir())]


TINY_T5 = "num_layers=1,num_decoder_layers=1,d_model=32,d_kv=8,d_ff=64,num_heads=4"


@pytest.mark.parametrize("model,extra,message", [
    ("gpt2", ("--objective", "span_corruption"),
     "--objective span_corruption does not train a decoder-only model ('gpt2'); its "
     "objective is causal (leave --objective unset)"),
    # T5's default objective is span corruption; the built-in tokenizer has no sentinels.
    ("t5", (), "span corruption needs T5's sentinel tokens (<extra_id_0>, ...), and the "
               "tokenizer {tok} has none: use a T5 tokenizer, or train one with "
               "`raylm tokenizer train --extra_ids 100`"),
    ("t5", ("--line_by_line",), "span corruption cuts spans out of packed blocks: drop "
                                "--line_by_line (or train with --objective seq2seq)"),
    ("t5", ("--tokenizer_name", "{t5tok}", "--max_seq_length", "60"),
     "span corruption of 66-token samples cuts 3 spans, but the tokenizer has 2 sentinel "
     "tokens: use a shorter --max_seq_length or a tokenizer with more (raylm tokenizer "
     "train --extra_ids N)"),
])
def test_span_corruption_bad_input(model, extra, message, tmp_path, capsys, corpus_dir,
                                   cache_root):
    from raylm.data.sources import builtin_tokenizer_dir
    from raylm.data.tokenizer_train import train_tokenizer

    t5tok = str(tmp_path / "t5tok")
    if "{t5tok}" in extra:
        train_tokenizer([str(corpus_dir / "macbeth.txt")], t5tok, vocab_size=300, extra_ids=2)
    args = base_args(tmp_path, corpus_dir, cache_root)
    if model == "t5":
        args[args.index("--model_type") + 1] = "t5"
        args[args.index("--config_overrides") + 1] = TINY_T5
    rc, errors, _ = run_cli(capsys, *args, *[a.replace("{t5tok}", t5tok) for a in extra])
    assert rc == 2
    assert errors == ["raylm: error: " + message.format(tok=builtin_tokenizer_dir())]


@pytest.mark.parametrize("extra,message", [
    (("--use_peft", "--lora_target_modules", "q_proj", "v_proj"),
     "--lora_target_modules q_proj v_proj: Target modules {'q_proj', 'v_proj'} not found in "
     "the base model. Please check the target modules and try again. (this gpt2 model's "
     "linear layers: c_attn, c_proj, c_fc, lm_head)"),
    (("--lora_rank", "4"), "--lora_rank is a LoRA setting: add --use_peft to fine-tune with "
                           "LoRA"),
    (("--merge_lora",), "--merge_lora is a LoRA setting: add --use_peft to fine-tune with "
                        "LoRA"),
    (("--use_peft", "--lora_dropout", "1.5"), "--lora_dropout must be in [0, 1) (got 1.5)"),
    (("--use_peft", "--lora_rank", "0"), "--lora_rank must be at least 1 (got 0)"),
    (("--use_peft", "--tp", "2", "--num_workers", "2", "--sequence_parallel"),
     "--sequence_parallel: sequence parallelism with LoRA adapters is not supported yet; "
     "drop --sequence_parallel (tensor parallelism alone shards the adapters)"),
])
def test_lora_bad_input(extra, message, tmp_path, capsys, corpus_dir, cache_root):
    rc, errors, err = run_cli(capsys, *base_args(tmp_path, corpus_dir, cache_root), *extra)
    assert rc == 2 and "Traceback" not in err
    if "{'q_proj', 'v_proj'}" in message:  # (a set: either order)
        alt = message.replace("{'q_proj', 'v_proj'}", "{'v_proj', 'q_proj'}")
        assert errors in (["raylm: error: " + message], ["raylm: error: " + alt])
    else:
        assert errors == ["raylm: error: " + message]


def test_profile_steps_below_one(tmp_path, capsys, corpus_dir, cache_root):
    rc, errors, _ = run_cli(capsys, *base_args(tmp_path, corpus_dir, cache_root), "--profile",
                            "--profile_steps", "0")
    assert rc == 2 and errors == ["raylm: error: --profile_steps must be >= 1 (got 0)"]


def test_output_dir_of_a_different_run(tmp_path, capsys, corpus_dir, cache_root):
    out = tmp_path / "out"
    out.mkdir()
    (out / "raylm_run.json").write_text(json.dumps({"digest": "something-else", "seed": 1}))
    rc, errors, _ = run_cli(capsys, *base_args(tmp_path, corpus_dir, cache_root))
    assert rc == 2
    assert len(errors) == 1 and "holds a different run" in errors[0]
    assert "--overwrite_output_dir" in errors[0]


def test_output_dir_not_empty(tmp_path, capsys, corpus_dir, cache_root):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    rc, errors, _ = run_cli(capsys, *base_args(tmp_path, corpus_dir, cache_root))
    assert rc == 2 and "already exists and is not empty" in errors[0]


def test_more_workers_than_the_cluster_can_place(ray_cluster, tmp_path, corpus_dir,
                                                 cache_root):
    cfg = TrainConfig(model_type="gpt2", config_overrides=TINY_GPT2,
                      train_file=[str(corpus_dir)], block_size=32, data_cache_dir=cache_root,
                      output_dir=str(tmp_path / "out"), max_steps=2, num_workers=9)
    driver = Driver(cfg)
    with pytest.raises(ConfigError, match="--num_workers 9: the cluster can place only 4"):
        driver.run()
    assert driver.workers == [] and driver.state == "planning"


def test_run_file_unknown_key(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("max_steps: 3\nlearning_rte: 0.1\n")
    rc, errors, _ = run_cli(capsys, str(run))
    assert rc == 2
    assert errors == [f"raylm: error: run file {run}: unknown key 'learning_rte' "
                      "(did you mean 'learning_rate'?)"]


def test_parquet_without_text_column(tmp_path, capsys, cache_root):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": [1, 2, 3]}), data)
    rc, errors, _ = run_cli(capsys, *base_args(tmp_path, data, cache_root))
    assert rc == 2 and len(errors) == 1 and "d.parquet" in errors[0]


@pytest.mark.parametrize("kw,message", [
    (dict(pp=4, gradient_accumulation_steps=2),
     "--pipeline_schedule 1f1b needs at least as many micro-batches per step as pipeline "
     "stages: --gradient_accumulation_steps 2 < --pp 4"),
    (dict(pp=2, gradient_accumulation_steps=1, pipeline_schedule="zero_bubble"),
     "--pipeline_schedule zero_bubble needs at least as many micro-batches"),
    (dict(pp=2, gradient_accumulation_steps=5, pipeline_schedule="interleaved_1f1b"),
     "--gradient_accumulation_steps 5 must be below 2 or a multiple of it"),
    (dict(pp=2, gradient_accumulation_steps=2, pp_split="1,2"),
     "--pp_split needs 1 boundary(ies) for 2 stages, got 2"),
    (dict(pp=2, gradient_accumulation_steps=2, pp_split="2"),
     "boundaries must increase strictly within 1..1 (the model has 2 blocks)"),
    (dict(pp=4, gradient_accumulation_steps=4),
     "pp=4 = 4 stages, but the model has only 2 blocks to divide"),
    (dict(pp=2, num_workers=3, gradient_accumulation_steps=2),
     "does not equal --num_workers 3"),
])
def test_pipeline_layout_errors_before_any_actor(kw, message, ray_cluster, tmp_path,
                                                 corpus_dir, cache_root):
    assert_fails_before_any_actor(message, tmp_path, corpus_dir, cache_root, **kw)


def assert_fails_before_any_actor(message, tmp_path, corpus_dir, cache_root,
                                  model_type="gpt2", config_overrides=TINY_GPT2, **kw):
    """A run of the tiny model with ``kw`` fails with one line holding ``message``,
    raised while planning: no rank actor was started."""
    cfg = TrainConfig(model_type=model_type, config_overrides=config_overrides,
                      train_file=[str(corpus_dir)], block_size=32, data_cache_dir=cache_root,
                      output_dir=str(tmp_path / "out"), max_steps=2, **kw)
    driver = Driver(cfg)
    with pytest.raises(ConfigError) as err:
        driver.run()
    assert message in str(err.value) and "\n" not in str(err.value)
    assert driver.workers == [] and driver.state == "planning"


@pytest.mark.parametrize("kw,overrides,message", [
    # TINY_GPT2 has 2 attention heads.
    (dict(tp=4, num_workers=4), TINY_GPT2, "heads"),
    # Grouped-query attention: 4 query heads but 2 key-value heads.
    (dict(tp=4, num_workers=4), "num_hidden_layers=2,hidden_size=32,num_attention_heads=4,"
     "num_key_value_heads=2,intermediate_size=64,max_position_embeddings=64",
     "key-value heads"),
    (dict(tp=2, pp=2, num_workers=4, sequence_parallel=True, gradient_accumulation_steps=2),
     TINY_GPT2, "--sequence_parallel with --pp > 1"),
    (dict(tp=2, num_workers=3), TINY_GPT2, "does not equal --num_workers 3"),
    (dict(pp=2, num_workers=2, pipeline_schedule="zero_bubble", gradient_accumulation_steps=2,
          activation_checkpointing="selective"), TINY_GPT2,
     "--activation_checkpointing selective with --pipeline_schedule zero_bubble"),
    (dict(num_workers=1, gradient_checkpointing=True, activation_checkpointing="none"),
     TINY_GPT2, "--gradient_checkpointing with --activation_checkpointing none"),
    # The test cluster's one node has 4 CPUs: one rank of 3.
    (dict(tp=2, num_workers=2, cpus_per_worker=3), TINY_GPT2,
     "--tp 2: a tensor-parallel group stays on one node, and the largest node here holds 1 "
     "rank(s) of 3 CPU"),
])
def test_tensor_layout_errors_before_any_actor(kw, overrides, message, ray_cluster, tmp_path,
                                               corpus_dir, cache_root):
    model_type = "llama" if "key-value" in message else "gpt2"
    assert_fails_before_any_actor(message, tmp_path, corpus_dir, cache_root, model_type,
                                  overrides, **{"cpus_per_worker": 0.5, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(zero_optimization=True, zero_stage=2),
     "--zero_optimization True means --zero_stage 1, which conflicts with --zero_stage 2"),
    (dict(zero_stage=1, cpu_offload=True), "--cpu_offload needs --use_gpu"),
    (dict(zero_stage=0, cpu_offload=True, use_gpu=True),
     "--cpu_offload needs --zero_stage 3"),
    (dict(zero_stage=2, cpu_offload=True, use_gpu=True),
     "stages 1 and 2 do not offload yet; --zero_stage is 2"),
])
def test_zero_flag_errors_before_any_actor(kw, message, ray_cluster, tmp_path, corpus_dir,
                                           cache_root):
    assert_fails_before_any_actor(message, tmp_path, corpus_dir, cache_root, num_workers=2,
                                  **kw)


def test_zero_flag_conflict_is_one_line_from_the_command(tmp_path, capsys, corpus_dir,
                                                         cache_root):
    rc, errors, err = run_cli(capsys, *base_args(tmp_path, corpus_dir, cache_root),
                              "--zero_optimization", "true", "--zero_stage", "3")
    assert rc == 2 and "Traceback" not in err
    assert errors == ["raylm: error: --zero_optimization True means --zero_stage 1, which "
                      "conflicts with --zero_stage 3: give one of the two"]


@pytest.mark.parametrize("flags,message", [
    (["--bf16", "--fp16"], "--bf16 and --fp16 both given: choose one"),
    (["--reduce_dtype", "bfloat16"], "--reduce_dtype bfloat16 needs --bf16 or --fp16"),
    (["--bf16", "--reduce_dtype", "bfloat16", "--zero_stage", "2"],
     "this layout runs ZeRO-2, whose reduce-scatter is fp32 only"),
    (["--fp16", "--initial_loss_scale", "0"], "--initial_loss_scale 0 must be > 0"),
    (["--torch_compile", "--pp", "2", "--num_workers", "2", "--gradient_accumulation_steps",
      "2", "--model_type", "gpt_neox", "--config_overrides",
      "num_hidden_layers=2,hidden_size=32,num_attention_heads=4,intermediate_size=64,"
      "max_position_embeddings=64"],
     "--torch_compile with --pp 2: raylm cuts 'gpt_neox' into stages by tracing it"),
    (["--torch_compile", "--torch_compile_scope", "model", "--num_workers", "2",
      "--tp", "2", "--cpus_per_worker", "0.5"],
     "--torch_compile_scope model compiles the rank's whole forward, and this layout has "
     "--tp 2"),
    (["--tp", "2", "--pp", "2", "--num_workers", "4", "--cpus_per_worker", "0.5",
      "--gradient_accumulation_steps", "2", "--model_type", "gpt_neox", "--config_overrides",
      "num_hidden_layers=2,hidden_size=32,num_attention_heads=4,intermediate_size=64,"
      "max_position_embeddings=64"],
     "--tp 2 with --pp 2: raylm cuts 'gpt_neox' into stages by tracing it with "
     "torch.export, whose graphs take a plan of layers only (a model of your own's"),
])
def test_precision_and_compile_flag_errors_are_one_line_from_the_command(flags, message, tmp_path, capsys,
                                                             corpus_dir, cache_root):
    rc, errors, err = run_cli(capsys, *base_args(tmp_path, corpus_dir, cache_root), *flags)
    assert rc == 2 and "Traceback" not in err
    assert len(errors) == 1 and message in errors[0], errors


def test_an_nccl_that_cannot_abort_its_communicators_together_is_refused():
    """--use_gpu recovers in memory by aborting each rank's NCCL communicators together,
    which NCCL does since 2.22; an older one is one clear error, a newer one passes."""
    from raylm.runtime.input_checks import check_nccl

    gpu = TrainConfig(train_file=["x.txt"], use_gpu=True)
    with pytest.raises(ConfigError, match=r"NCCL is 2\.21\.5; .* needs NCCL 2\.22 or later"):
        check_nccl(gpu, (2, 21, 5))
    check_nccl(gpu, (2, 22, 3))
    check_nccl(gpu, (2, 27, 7))
    check_nccl(TrainConfig(train_file=["x.txt"]), (2, 18, 1))  # (CPU ranks: gloo)
