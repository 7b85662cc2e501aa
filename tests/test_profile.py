"""Where a step's time goes: the breakdown every run logs in metrics.jsonl, and --profile's
torch-profiler trace of every rank; where the start-up went (all_results.json's startup_s)."""

from __future__ import annotations

import json
import os
import time

from raylm import TrainConfig, train
from raylm.runtime.metrics import read_metrics, scalars
from raylm.runtime.driver import STARTUP_PARTS
from raylm.runtime.profiling import BREAKDOWN
from tests.conftest import TINY_GPT2


def test_profile_traces_every_rank_and_every_step_logs_its_breakdown(ray_cluster, corpus_dir,
                                                                     cache_root, tmp_path):
    out = tmp_path / "out"
    t0 = time.time()
    result = train(TrainConfig(
        model_type="gpt2", config_overrides=TINY_GPT2, train_file=[str(corpus_dir)],
        block_size=32, data_cache_dir=cache_root, output_dir=str(out), max_steps=5,
        logging_steps=2, save_steps=1000, disable_tqdm=True, num_workers=2,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, cpus_per_worker=0.5,
        profile=True, profile_steps=2))
    wall = time.time() - t0

    # Where the start-up went: every part of a fresh run's, within the call's time.
    startup = result.metrics["startup_s"]
    assert set(startup) == {k for k, _ in STARTUP_PARTS if k != "restore"} | {"first_step"}
    assert all(v >= 0 for v in startup.values()) and sum(startup.values()) < wall
    assert startup["processes"] > 0 and startup["engines"] > 0
    assert json.load(open(out / "all_results.json"))["startup_s"] == startup

    # Steps 3 and 4 traced on both ranks (the first step is not, the second warms up),
    # with raylm's regions in them.
    for rank in (0, 1):
        trace = json.load(open(out / "profile" / f"rank-{rank}.json"))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names, rank
        assert not any(n and n.startswith("ProfilerStep#") and n[-1] in "014" for n in names)
        assert {"raylm.forward_backward", "raylm.clip", "raylm.optimizer"} <= names
    assert not os.path.exists(out / "profile" / "rank-0.json.tmp")

    # Each step: the slowest rank's parts, which fit in the step's wall time.
    for h in result.history:
        parts = h["breakdown"]
        assert set(parts) == set(BREAKDOWN) and all(v >= 0 for v in parts.values()), parts
        assert parts["forward_backward_s"] > 0 and parts["clip_s"] > 0
        assert sum(v for k, v in parts.items() if k != "boundary_idle_s") <= h["step_time_s"]
    assert all(h["breakdown"]["optimizer_s"] > 0 for h in result.history[1:])
    # metrics.jsonl: each logging window's means, which TensorBoard and W&B get as
    # train/breakdown/<part>.
    logged = [r for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 5]
    for r in logged:
        assert set(r["breakdown"]) == set(BREAKDOWN)
        assert sum(r["breakdown"].values()) <= 1.05 * r["step_time_s"] + 0.01
        assert "train/breakdown/forward_backward_s" in scalars(r)
