"""Resume and fault tolerance: an interrupted run continues with the uninterrupted losses.

Dropout is on here, so equal losses also prove that each rank's RNG, the optimizer, the
LR schedule and the data position were all restored.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from raylm import TrainConfig, train
from raylm.cli.main import main
from tests.conftest import CPUS, TINY_GPT2_DROPOUT
from tests.dashboards import tensorboard_scalars, wandb_history

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)

STEPS = 20
SAVE = 10


def run_config(out, corpus, cache_root, **kw) -> TrainConfig:
    base = dict(model_type="gpt2", config_overrides=TINY_GPT2_DROPOUT,
                train_file=[str(corpus)], block_size=32, data_cache_dir=cache_root,
                output_dir=str(out), max_steps=STEPS, save_steps=SAVE, logging_steps=1,
                disable_tqdm=True, learning_rate=1e-3, num_workers=2,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                do_eval=False, cpus_per_worker=CPUS)
    base.update(kw)
    return TrainConfig(**base)


def logged_losses(output_dir) -> dict:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    result = train(run_config(tmp_path_factory.mktemp("base") / "out", corpus_dir, cache_root))
    return {h["step"]: h["loss"] for h in result.history}


class KillRank:
    """Kills one rank actor's process (SIGKILL, by pid) when a step ends."""

    def __init__(self, at_step: int, rank: int):
        self.at_step, self.rank, self.killed = at_step, rank, None

    def on_step_end(self, driver, step, record):
        if step == self.at_step and self.killed is None:
            self.killed = driver.worker_pids[self.rank]
            os.kill(self.killed, signal.SIGKILL)


def test_rank_killed_mid_run_recovers_with_same_losses(uninterrupted, ray_cluster, corpus_dir,
                                                       cache_root, tmp_path, caplog):
    """With --min_workers 2 the one survivor may not carry on alone (tests/test_elastic.py
    has the in-memory shrink): the group restarts from the latest checkpoint."""
    killer = KillRank(at_step=13, rank=1)
    caplog.set_level("INFO", logger="raylm")
    result = train(run_config(tmp_path / "out", corpus_dir, cache_root, min_workers=2,
                              report_to=["tensorboard", "wandb"]),
                   callbacks=(killer,))

    assert killer.killed is not None
    assert result.failures == 1
    losses = {h["step"]: h["loss"] for h in result.history}
    assert sorted(losses) == list(range(1, STEPS + 1))
    steps = list(range(1, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in steps], [uninterrupted[s] for s in steps],
                               rtol=1e-5)
    # The file log is the uninterrupted history too: redone steps replace the lost ones.
    logged = logged_losses(result.output_dir)
    np.testing.assert_allclose([logged[s] for s in steps], [uninterrupted[s] for s in steps],
                               rtol=1e-5)
    log = caplog.text
    assert "recovering" in log
    assert f"pid {killer.killed}" in log
    # The failure surfaces at step 14 (the next one the ranks run); everything after the
    # step-10 checkpoint is redone.
    failed = int(re.search(r"rank failure at step (\d+)", log).group(1))
    assert failed >= 14
    assert f"step-{SAVE:08d}: {failed - 1 - SAVE} step(s) will be redone" in log

    # The failure is an event in metrics.jsonl, at the last step done before it.
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        events = [r for r in map(json.loads, f) if "event" in r]
    assert [(e["event"], e["step"], e["world_size"]) for e in events] == \
        [("failure", failed - 1, 2)]
    # TensorBoard shows each step once, the redone steps' values replacing the lost
    # ones (the restore purged them); W&B has every step, redone ones logged again at
    # their global_step, the last of each the uninterrupted loss.
    shown = tensorboard_scalars(os.path.join(result.output_dir, "runs"))
    assert sorted(shown["train/loss"]) == steps
    np.testing.assert_allclose([shown["train/loss"][s] for s in steps],
                               [uninterrupted[s] for s in steps], rtol=1e-5)
    assert {"train/learning_rate", "train/grad_norm", "train/tokens_per_second",
            "train/step_time_s"} <= set(shown)
    import wandb

    wandb.teardown()  # the wandb service process this test's run started
    rows = [r for r in wandb_history(result.output_dir) if "train/loss" in r]
    assert len(rows) == STEPS + failed - 1 - SAVE
    last = {r["train/global_step"]: r["train/loss"] for r in rows}
    np.testing.assert_allclose([last[s] for s in steps], [uninterrupted[s] for s in steps],
                               rtol=1e-5)
    # raylm plot draws it, the failure marked.
    assert main(["plot", result.output_dir]) == 0
    png = os.path.join(result.output_dir, "metrics.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000


def test_killed_driver_resumes_by_rerunning_the_command(uninterrupted, ray_address, corpus_dir,
                                                        cache_root, tmp_path):
    out = tmp_path / "out"
    address = ray_address
    cmd = [sys.executable, "-m", "raylm.cli.main", "train", "--model_type", "gpt2",
           "--config_overrides", TINY_GPT2_DROPOUT, "--train_file", str(corpus_dir),
           "--block_size", "32", "--data_cache_dir", cache_root, "--output_dir", str(out),
           "--max_steps", str(STEPS), "--save_steps", str(SAVE), "--logging_steps", "1",
           "--learning_rate", "1e-3", "--num_workers", "2",
           "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
           "--do_eval", "false", "--address", address]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoint = out / "checkpoints" / f"step-{SAVE:08d}" / "trainer_state.json"
    deadline = time.time() + 240
    try:
        while not checkpoint.exists():
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "no checkpoint at step 10"
            time.sleep(0.1)
    finally:
        first.kill()  # the driver dies; Ray reaps its rank actors with its job
        first.wait()
    assert first.returncode == -signal.SIGKILL

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from {checkpoint.parent}" in second.stderr
    logged = logged_losses(out)
    assert sorted(logged) == list(range(1, STEPS + 1))
    steps = list(range(SAVE + 1, STEPS + 1))
    np.testing.assert_allclose([logged[s] for s in steps], [uninterrupted[s] for s in steps],
                               rtol=1e-5)
