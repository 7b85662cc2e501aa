"""`raylm plan`: the layout a run would use, from flags alone (no Ray, no weights)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from raylm.cli.main import main

GPT2_4 = ("--model_type", "gpt2", "--config_overrides",
          "n_layer=4,n_embd=32,n_head=2,n_positions=64")
LLAMA_70B = ("hidden_size=8192,num_hidden_layers=80,num_attention_heads=64,"
             "num_key_value_heads=8,intermediate_size=28672,vocab_size=128256,"
             "max_position_embeddings=4096")


def plan(capsys, *args):
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys, *args):
    rc, out, err = plan(capsys, "--json", *args)
    assert rc == 0, err
    return json.loads(out)


def reference_params(*args):
    """The model's distinct parameters, counted by transformers itself (meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from raylm.cli.args import config_from_namespace
    from raylm.cli.main import build_parser
    from raylm.models.loading import resolve_model

    cfg = config_from_namespace(build_parser().parse_args(["plan", *args]), {})
    spec = resolve_model(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.config)
    return sum(p.numel() for p in model.parameters()), spec.config


def test_pp2_names_the_modules_of_each_stage(capsys):
    args = (*GPT2_4, "--pp", "2", "--gradient_accumulation_steps", "2")
    rep = plan_json(capsys, *args)
    assert rep["plan"]["pp"] == 2 and rep["plan"]["dp"] == 1
    s0, s1 = rep["stages"]
    assert (s0["pp_rank"], s1["pp_rank"]) == (0, 1)
    assert s0["embeddings"] and not s0["head"]
    assert s1["head"] and not s1["embeddings"]
    assert rep["model"]["embeddings"] == "embeddings (transformer.wte, transformer.wpe)"
    assert rep["model"]["head"] == "transformer.ln_f, lm_head"
    # contiguous, in order, covering every block exactly once
    assert s0["blocks"] + s1["blocks"] == [f"transformer.h.{i}" for i in range(4)]
    assert s0["blocks"] and s1["blocks"]
    assert s0["last_block"] + 1 == s1["first_block"]
    assert [s["num_blocks"] for s in rep["stages"]] == [len(s0["blocks"]), len(s1["blocks"])]

    # The table says the same, one aligned row per stage.
    rc, out, err = plan(capsys, *args)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("plan: 2 rank(s): dp=1 x pp=2 x tp=1")
    assert "transformer.wte, transformer.wpe" in out and "lm_head" in out
    header = next(i for i, l in enumerate(lines) if l.startswith("stage  pp rank"))
    table = lines[header:header + 3]
    assert len({len(l) for l in table}) == 1, table  # right-aligned last column
    row0, row1 = table[1].split(), table[2].split()
    assert row0[:2] == ["0", "0"] and row1[:2] == ["1", "1"]
    assert s0["blocks"][0] in table[1] and s0["blocks"][-1] in table[1]
    assert s1["blocks"][0] in table[2] and s1["blocks"][-1] in table[2]
    assert "yes" in table[1].split("transformer.h")[-1].split()[:3]  # embed column
    assert "tied: transformer.wte.weight is held by pp ranks 0, 1" in out


def test_pp_split_is_honoured(capsys):
    rep = plan_json(capsys, *GPT2_4, "--pp", "2", "--pp_split", "1",
                    "--gradient_accumulation_steps", "2")
    assert [s["blocks"] for s in rep["stages"]] == [
        ["transformer.h.0"], ["transformer.h.1", "transformer.h.2", "transformer.h.3"]]
    assert rep["plan"]["stage_bounds"] == [[0, 1], [1, 4]]
    assert "blocks 0-0 | 1-3" in rep["layout"]

    # Interleaved: 2 ranks x 2 virtual stages, round-robin, at the given cuts.
    rep = plan_json(capsys, *GPT2_4, "--pp", "2", "--pipeline_schedule", "interleaved_1f1b",
                    "--pp_split", "1,2,3", "--gradient_accumulation_steps", "4")
    assert [s["blocks"] for s in rep["stages"]] == [[f"transformer.h.{i}"] for i in range(4)]
    assert [s["pp_rank"] for s in rep["stages"]] == [0, 1, 0, 1]
    assert [r["stages"] for r in rep["ranks"]] == [[0, 2], [1, 3]]
    rc, out, _ = plan(capsys, *GPT2_4, "--pp", "2", "--pipeline_schedule", "interleaved_1f1b",
                      "--pp_split", "1,2,3", "--gradient_accumulation_steps", "4")
    assert rc == 0 and "pp rank  stages" in out  # per-rank table when a rank runs 2 stages


def test_parameters_sum_to_the_model_with_the_tied_embedding_twice(capsys):
    args = (*GPT2_4, "--pp", "2", "--gradient_accumulation_steps", "4")
    rep = plan_json(capsys, *args)
    total, config = reference_params(*args)
    wte = config.vocab_size * config.n_embd
    assert rep["model"]["parameters"] == total
    assert sum(s["parameters"] for s in rep["stages"]) == total + wte
    assert sum(r["parameters"] for r in rep["ranks"]) == total + wte
    assert rep["tied"] == {"transformer.wte.weight": [0, 1]}
    for s in rep["stages"]:
        assert s["weight_bytes"] == 16 * s["parameters"]
        assert s["total_bytes"] == s["weight_bytes"] + s["activation_bytes"]
    # 1F1B: stage s holds min(micro-batches, stages - s) micro-batches at its peak.
    assert [s["in_flight"] for s in rep["stages"]] == [2, 1]
    # A stage's activations: its blocks' (plus the embedding's on stage 0, the head's on
    # the last) per micro-batch, times the micro-batches in flight.
    est = rep["estimate"]
    s0, s1 = rep["stages"]
    assert s0["activation_bytes"] == pytest.approx(
        (est["activation_bytes_per_block"] * s0["num_blocks"]
         + est["embedding_activation_bytes"]) * 2)
    assert s1["activation_bytes"] == pytest.approx(
        est["activation_bytes_per_block"] * s1["num_blocks"] + est["head_activation_bytes"])
    # The cost model's pp ranks hold what the runtime's cut gives them.
    assert [r["local_parameters"] for r in rep["ranks"]] == [r["parameters"]
                                                            for r in rep["ranks"]]


def test_zero_bubble_shares_rank0_between_first_and_last_stage(capsys):
    args = (*GPT2_4, "--pp", "2", "--pipeline_schedule", "zero_bubble",
            "--gradient_accumulation_steps", "4")
    rep = plan_json(capsys, *args)
    total, _ = reference_params(*args)
    assert [s["pp_rank"] for s in rep["stages"]] == [0, 1, 1, 0]
    assert rep["stages"][0]["embeddings"] and rep["stages"][3]["head"]
    # rank 0 holds the tied wte once although two of its stages use it
    assert sum(r["parameters"] for r in rep["ranks"]) == total
    assert rep["tied"] == {}


def test_pp1_is_one_line_for_the_whole_model(capsys):
    args = (*GPT2_4, "--num_workers", "3")
    rc, out, err = plan(capsys, *args)
    assert rc == 0, err
    total, _ = reference_params(*args)
    assert "dp=3 x pp=1 x tp=1" in out
    [line] = [l for l in out.splitlines() if "holds the whole model" in l]
    assert f"{total:,} parameters" in line and "activations" in line
    # (its total is the per-worker memory's without the workspace: said, not left to guess)
    assert line.endswith("per rank, before the workspace that 'memory per worker' above adds")
    rep = plan_json(capsys, *args)
    assert rep["stages"] == [] and rep["ranks"][0]["parameters"] == total


def test_run_file_and_flags(capsys, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("model_type: gpt2\nconfig_overrides: n_layer=4,n_embd=32,n_head=2,"
                   "n_positions=64\npp: 2\ngradient_accumulation_steps: 2\n")
    rep = plan_json(capsys, str(run), "--pp_split", "3")
    assert rep["plan"]["stage_bounds"] == [[0, 3], [3, 4]]


@pytest.mark.parametrize("extra, words", [
    (("--pp", "2", "--pp_split", "1,2", "--gradient_accumulation_steps", "2"),
     ["--pp_split", "1 boundary"]),
    (("--pp", "8", "--gradient_accumulation_steps", "8"), ["8 stages", "only 4 blocks"]),
    (("--pp", "4", "--gradient_accumulation_steps", "2"), ["1f1b", "micro-batches"]),
    (("--pp", "2", "--num_workers", "3", "--gradient_accumulation_steps", "2"),
     ["--num_workers 3"]),
    (("--block_size", "65"), ["--block_size 65"]),
])
def test_bad_input_is_one_line(capsys, extra, words):
    rc, out, err = plan(capsys, *GPT2_4, *extra)
    assert rc == 2
    assert out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("raylm: error: ")
    for w in words:
        assert w in line, line


def test_bad_input_from_the_real_command():
    proc = subprocess.run([sys.executable, "-m", "raylm.cli.main", "plan", *GPT2_4,
                           "--pp", "5", "--gradient_accumulation_steps", "5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("raylm: error: ") and "only 4 blocks" in line, line


def test_70b_llama_plans_in_seconds_without_ray():
    # The real command's code path, in a fresh process that must not import Ray.
    script = ("import sys; from raylm.cli.main import main; rc = main(sys.argv[1:]); "
              "assert 'ray' not in sys.modules, 'plan imported ray'; sys.exit(rc)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, "plan", "--model_type", "llama",
                           "--config_overrides", LLAMA_70B, "--pp", "8", "--num_workers",
                           "8", "--block_size", "4096", "--gradient_accumulation_steps", "8",
                           "--per_device_train_batch_size", "1"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 20, f"raylm plan took {elapsed:.1f} s"
    out = proc.stdout
    h, i, kv, v, L = 8192, 28672, 1024, 128256, 80
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    total = 2 * v * h + L * block + h  # untied embedding and head, final norm
    assert f"{total:,} parameters" in out
    assert "dp=1 x pp=8 x tp=1" in out
    assert "model.layers.0 .. model.layers.9" in out
    assert "model.layers.79" in out
    rows = [l.split() for l in out.splitlines() if l[:6].strip().isdigit()]
    assert [r[0] for r in rows[:8]] == [str(s) for s in range(8)]


# -- ZeRO ----------------------------------------------------------------------------------
# States outweigh activations (hidden 256, 32-token blocks of 1 sequence): 4 workers of
# 26 MiB fit dp=4 at ZeRO-2 only (43.9 / 28.8 / 21.2 / 22.7 MiB at stages 0-3).
ZERO_GPT2 = ("--model_type", "gpt2", "--config_overrides",
             "n_layer=2,n_embd=256,n_head=4,n_positions=64", "--block_size", "32",
             "--per_device_train_batch_size", "1", "--num_workers", "4")


def test_plan_shows_each_zero_stage_and_who_owns_what(capsys):
    args = (*ZERO_GPT2, "--worker_memory_gb", "0.026")
    rc, out, err = plan(capsys, *args)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("plan: 4 rank(s): dp=4 x pp=1 x tp=1")
    assert lines[0].endswith("; ZeRO-2 (optimizer states and gradients partitioned over "
                             "dp=4)")
    head = lines.index(next(l for l in lines if l.startswith("ZeRO over each data-parallel")))
    assert "stage 2: planner: the lowest stage that fits" in lines[head]
    table = lines[head + 1:head + 6]
    assert table[0].split()[:3] == ["stage", "partitioned", "over"]
    assert [r.split()[0] for r in table[1:]] == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert [r.endswith("<- chosen") for r in table[1:]] == [False, False, True, False]
    assert [" no" in r for r in table[1:]] == [True, True, False, False]  # fits
    assert "ZeRO-2 ownership: each of the dp=4 ranks" in out
    [own] = [l for l in lines if l.startswith("  pp rank 0 (global ranks 0-3)")]
    assert "each dp rank owns" in own and "optimizer states" in own

    rep = plan_json(capsys, *args)
    z = rep["zero"]
    assert rep["plan"]["zero_stage"] == z["stage"] == rep["chosen"]["zero_stage"] == 2
    assert z["requested"] is None and z["chosen_by"].startswith("planner")
    assert [s["chosen"] for s in z["stages"]] == [False, False, True, False]
    assert [s["fits"] for s in z["stages"]] == [False, False, True, True]
    assert z["stages"][2]["total"] <= 0.026 * 2**30 < z["stages"][1]["total"]
    assert z["stages"][2]["total"] == pytest.approx(rep["memory"]["total"])
    s0, s2 = z["stages"][0], z["stages"][2]
    assert s2["parameters"] == s0["parameters"]  # stage 2 keeps whole parameters
    assert s2["gradients"] == pytest.approx(s0["gradients"] / 4)
    assert s2["optimizer"] == pytest.approx(s0["optimizer"] / 4)
    total, _ = reference_params(*args)
    owners = z["ownership"]
    assert [e["coords"]["dp"] for e in owners] == [0, 1, 2, 3]
    owned = [e["elements"]["owned"] for e in owners]
    assert sum(owned) == total and all(e["elements"]["held"] == total for e in owners)
    assert max(owned) - min(owned) <= 256 * 3  # to within a row of each tensor
    assert all(e["bytes"]["gradients"] == 4 * e["elements"]["owned"] for e in owners)
    assert all(e["bytes"]["parameters"] == 4 * total for e in owners)
    assert z["ownership_rows"] and owners[3]["rows"]["transformer.wte.weight"][1] == \
        rep["model"]["vocab_size"]
    assert z["ownership_summary"][0].startswith("ZeRO-2 ownership")


def test_plan_with_ample_memory_and_an_explicit_stage(capsys):
    rep = plan_json(capsys, *ZERO_GPT2)  # 16 GiB: no ZeRO
    assert rep["zero"]["stage"] == 0 and rep["zero"]["chosen_by"] == "fits without ZeRO"
    assert [s["chosen"] for s in rep["zero"]["stages"]] == [True, False, False, False]
    rc, out, _ = plan(capsys, *ZERO_GPT2)
    assert "ZeRO-0: no partition" in out and "ZeRO-" not in out.splitlines()[0]

    rep = plan_json(capsys, *ZERO_GPT2, "--dp", "4", "--zero_optimization", "true")
    assert rep["zero"]["stage"] == 1 and rep["zero"]["chosen_by"] == "flag"
    assert rep["memory"]["optimizer"] == pytest.approx(
        rep["zero"]["stages"][0]["optimizer"] / 4)


def test_a_zero3_peak_above_zero2s_is_explained(capsys):
    note = "(ZeRO-3's peak is above ZeRO-2's: it gathers each block's parameters"
    kept = plan_json(capsys, *ZERO_GPT2, "--zero_stage", "3", "--reshard_after_forward",
                     "false")["zero"]["stages"]
    assert kept[3]["total"] > kept[2]["total"]
    rc, out, _ = plan(capsys, *ZERO_GPT2, "--zero_stage", "3", "--reshard_after_forward",
                      "false")
    [line] = [l for l in out.splitlines() if l.strip().startswith(note)]
    assert "and here keeps them gathered through the step" in line
    # Freed after each forward: in a 2-block model the two gathered blocks still weigh
    # more than ZeRO-3 saves; in a 12-block GPT-2 they do not, and nothing is said.
    freed = plan(capsys, *ZERO_GPT2, "--zero_stage", "3", "--reshard_after_forward", "true")
    [line] = [l for l in freed[1].splitlines() if l.strip().startswith(note)]
    assert "keeps them" not in line
    gpt2 = ("--model_type", "gpt2", "--num_workers", "4", "--block_size", "128",
            "--zero_stage", "3", "--reshard_after_forward", "true")
    freed = plan_json(capsys, *gpt2)["zero"]["stages"]
    assert freed[3]["total"] < freed[2]["total"]
    assert note not in plan(capsys, *gpt2)[1]


@pytest.mark.parametrize("extra, words", [
    (("--zero_optimization", "true", "--zero_stage", "3"),
     ["--zero_optimization", "--zero_stage 3"]),
    (("--zero_stage", "1", "--cpu_offload"), ["--cpu_offload needs --use_gpu"]),
    (("--zero_stage", "0", "--cpu_offload", "--use_gpu"),
     ["--cpu_offload needs --zero_stage 3"]),
])
def test_zero_flag_errors_are_one_line(capsys, extra, words):
    rc, out, err = plan(capsys, *ZERO_GPT2, *extra)
    assert rc == 2 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("raylm: error: ")
    for w in words:
        assert w in line, line


# The same flags through `raylm plan` and through the driver of `raylm train` (its
# planning step, no actor): the same layout, micro-batching, schedule, ZeRO stage and stage
# cuts. Worker memory and node size are flags, so neither reads a cluster.
AGREE = [
    ("--num_workers", "4"),  # the planner's choice
    ("--dp", "2", "--pp", "2", "--num_workers", "4", "--gradient_accumulation_steps", "2"),
    ("--pp", "2", "--pp_split", "1", "--num_workers", "2", "--gradient_accumulation_steps",
     "2"),
    ("--pp", "2", "--pipeline_schedule", "interleaved_1f1b", "--num_workers", "2",
     "--gradient_accumulation_steps", "4"),
    ("--pp", "2", "--pipeline_schedule", "zero_bubble", "--num_workers", "4",
     "--gradient_accumulation_steps", "2"),
    ("--tp", "2", "--sequence_parallel", "True", "--num_workers", "4"),
    ("--num_workers", "2", "--zero_stage", "2"),
    # short of memory: the planner's ZeRO-1, and with --dp given the lowest fitting stage
    ("--num_workers", "4", "--per_device_train_batch_size", "1", "--worker_memory_gb",
     "0.0063"),
    ("--dp", "4", "--num_workers", "4", "--per_device_train_batch_size", "1",
     "--worker_memory_gb", "0.0063"),
]
PINNED = ("--workers_per_node", "8")


@pytest.mark.parametrize("flags", AGREE, ids=lambda f: " ".join(f))
def test_plan_prints_the_plan_train_runs(capsys, tmp_path, flags):
    from raylm.cli.args import config_from_namespace
    from raylm.cli.main import build_parser
    from raylm.runtime.driver import Driver
    from raylm.runtime.input_checks import check_inputs

    args = (*GPT2_4, *flags, *PINNED)
    if "--worker_memory_gb" not in flags:
        args += ("--worker_memory_gb", "16")
    printed = plan_json(capsys, *args)["plan"]
    cfg = config_from_namespace(build_parser().parse_args(
        ["train", *args, "--output_dir", str(tmp_path / "out")]), {})
    run = Driver(cfg).plan(check_inputs(cfg), capacity=cfg.num_workers)
    assert {k: printed[k] for k in ("dp", "pp", "tp")} == run.dims.to_dict()
    for key in ("micro_batch_size", "global_batch_size", "micro_batches_per_rank", "schedule",
                "virtual", "sequence_parallel", "zero_stage"):
        assert printed[key] == getattr(run, key), key
    assert printed["stage_bounds"] == [list(b) for b in run.stage_bounds]
    if "0.0063" in flags:  # the memory-short sets really exercise the ZeRO choice
        assert run.zero_stage == 1


def test_pp_split_without_pp_is_one_error_for_plan_and_train(capsys, tmp_path):
    from raylm.cli.args import config_from_namespace
    from raylm.cli.main import build_parser
    from raylm.errors import ConfigError
    from raylm.runtime.driver import Driver
    from raylm.runtime.input_checks import check_inputs

    rc, out, err = plan(capsys, *GPT2_4, "--pp_split", "2", "--num_workers", "2")
    assert rc == 2 and out == ""
    assert "--pp_split 2 cuts the model into 2 stages: give --pp 2 with it" in err
    cfg = config_from_namespace(build_parser().parse_args(
        ["train", *GPT2_4, "--pp_split", "2", "--num_workers", "2", "--output_dir",
         str(tmp_path / "out")]), {})
    with pytest.raises(ConfigError, match="give --pp 2 with it"):
        Driver(cfg).plan(check_inputs(cfg), capacity=2)
