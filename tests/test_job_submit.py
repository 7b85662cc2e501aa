"""The job path: `ray job submit ... -- python jobs/train.py` on a real `ray start` cluster.

A head node of its own (non-default ports, its own temp dir, token auth with its own token;
see tests/helpers_cluster.py), a 4-step run with 2 rank actors submitted as a Ray job with
the repository as working_dir, then: the output directory is an ordinary Hugging Face model
(AutoModelForCausalLM / AutoTokenizer load it and generate), metrics.jsonl has every step,
and no process of the cluster is left once it is stopped.

Facts this relies on (Ray 2.60, checked here):
* `ray start` turns token auth on when a token is available (RAY_AUTH_TOKEN, or
  ~/.ray/auth_token, which any local `ray.init()` creates). A client then needs
  RAY_AUTH_MODE=token plus the token, or its requests get 401 "Missing authentication
  token". The test sets both explicitly for the cluster and the client.
* `ray job submit --working-dir` honours .gitignore and always excludes .git, .venv, venv
  and __pycache__ (RAY_RUNTIME_ENV_DEFAULT_EXCLUDES); the explicit excludes below keep the
  package small even where those defaults are overridden.
* The job's entrypoint inherits the cluster's environment, so `python` is the venv's because
  the cluster was started with the venv's bin first on PATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.conftest import REPO, TINY_GPT2
from tests.helpers_cluster import RAY_BIN, HeadNode

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)

STEPS = 4
EXCLUDES = [".venv", "venv", ".git", "**/__pycache__", ".pytest_cache", "*.egg-info",
            "raylm-output", "build"]


def _train_file() -> str:
    from raylm.data.sources import builtin_sample_files

    return sorted(builtin_sample_files())[0]  # one play, ~90 kB


@pytest.mark.timeout(300)
def test_ray_job_submit_trains_and_leaves_nothing_running(tmp_path):
    out = tmp_path / "out"
    cache = tmp_path / "cache"
    train_file = _train_file()
    job_flags = [
        "--model_type", "gpt2", "--config_overrides", TINY_GPT2,
        "--train_file", train_file, "--block_size", "32",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
        "--max_steps", str(STEPS), "--logging_steps", "1", "--save_steps", "2",
        "--output_dir", str(out), "--data_cache_dir", str(cache),
        "--num_workers", "2", "--cpus_per_worker", "0.5",
        "--do_eval", "false", "--disable_tqdm",
    ]

    head = HeadNode(num_cpus=2)
    with head:
        cmd = [RAY_BIN, "job", "submit", "--address", head.dashboard_url,
               "--working-dir", str(REPO),
               "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
               "--", "python", "jobs/train.py", *job_flags]
        t0 = time.time()
        proc = subprocess.run(cmd, env=head.client_env(), capture_output=True, text=True,
                              timeout=240, cwd=str(tmp_path))
        job_s = time.time() - t0
        log = proc.stdout + proc.stderr
        tail = "\n".join(log.splitlines()[-60:])
        assert proc.returncode == 0, f"ray job submit failed ({proc.returncode}):\n{tail}"
        assert "succeeded" in log, tail
        # The job's driver joined this cluster (RAY_ADDRESS from the job), not a new local one.
        assert "joining the Ray cluster" in log, tail
        assert "starting a local Ray cluster" not in log, tail
        pids_while_up = head.alive()
        assert pids_while_up, "the cluster's processes were not found"
    # Leaving the `with` stopped the cluster by pid and checked nothing survived; check again
    # from scratch with the pids seen while it ran.
    survivors = {pid: c for pid, c in pids_while_up.items() if _running(pid, c)}
    assert not survivors, f"still running after stop: {survivors}"
    assert not os.path.exists(head.temp_dir)

    # metrics.jsonl: one train record per step (logging_steps=1), in order.
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, STEPS + 1)), records
    for r in train_records:
        assert r["loss"] > 0 and r["tokens_per_second"] > 0 and "learning_rate" in r
    results = json.loads((out / "all_results.json").read_text())
    assert results["global_step"] == STEPS and results["world_size"] == 2, results

    # The output is an ordinary Hugging Face model directory.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.n_layer == 2 and model.config.n_embd == 32
    inputs = tok("First Merchant:", return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                             else tok.eos_token_id)
    assert gen.shape[1] == inputs["input_ids"].shape[1] + 5
    assert isinstance(tok.decode(gen[0]), str)
    print(f"job took {job_s:.1f} s")


def _running(pid: int, cmdline: str) -> bool:
    """Is this pid alive and still the same program (not a reused pid)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            now = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X") and now == cmdline
