"""The output directory: fresh, the same run's to resume, or an error (decided before
anything starts); and the run's fingerprint file written in it when the run starts."""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Optional

from raylm.checkpoint.manager import CheckpointManager, read_trainer_state
from raylm.config import TrainConfig
from raylm.errors import ConfigError
from raylm.runtime.inputs import Inputs

log = logging.getLogger("raylm")
# The run's fingerprint (TrainConfig.run_fingerprint): a re-run in the same output_dir
# with other settings is refused.
RUN_FINGERPRINT = "raylm_run.json"


def decide_output_dir(cfg: TrainConfig, inputs: Inputs) -> None:
    """Fresh, resumable (same run), or an error: decided before anything starts."""
    out = cfg.output_dir
    fingerprint_path = os.path.join(out, RUN_FINGERPRINT)
    if cfg.resume_from_checkpoint:
        if not os.path.isfile(os.path.join(cfg.resume_from_checkpoint, "trainer_state.json")):
            raise ConfigError(f"--resume_from_checkpoint: {cfg.resume_from_checkpoint} is not "
                              "a raylm checkpoint (no trainer_state.json)")
        if read_trainer_state(cfg.resume_from_checkpoint).get("model_only"):
            raise ConfigError(f"--resume_from_checkpoint: {cfg.resume_from_checkpoint} holds "
                              "the model only (--save_only_model): no optimizer state to "
                              "resume; fine-tune from it with --model_name_or_path instead")
        inputs.resume_from = os.path.abspath(cfg.resume_from_checkpoint)
        inputs.resumed_fingerprint = read_trainer_state(inputs.resume_from).get("run")
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if cfg.overwrite_output_dir:
        return  # cleared in start_output_dir, once the run really starts
    if not os.path.isfile(fingerprint_path):
        raise ConfigError(f"--output_dir {out} already exists and is not empty; use "
                          "--overwrite_output_dir to train over it")
    with open(fingerprint_path) as f:
        recorded = json.load(f)
    code = code_of(inputs)
    # (only the code's names may be missing from an older record: a dataset's digest
    # missing from the record is data the recorded run did not have)
    unrecorded = [k for k in ("model_init", "compute_loss_func")
                  if code.get(k) is not None and k not in recorded]
    if unrecorded and "model_init" not in recorded and "compute_loss_func" not in recorded:
        # A record written before raylm recorded the run's code: its settings still decide.
        log.warning("%s: the run record does not name the run's %s (written by an earlier "
                    "raylm): not checked", out, " or ".join(unrecorded))
        code = {k: v for k, v in code.items() if k not in unrecorded}
    mine = cfg.run_fingerprint(code)
    if recorded.get("digest") != mine["digest"]:
        differs = sorted(k for k in set(mine) | set(recorded)
                         if k not in ("digest", "global_batch_size")
                         and recorded.get(k) != mine.get(k))
        raise ConfigError(f"--output_dir {out} holds a different run (differs in: "
                          f"{', '.join(differs) or 'settings'}); use --overwrite_output_dir "
                          "or another --output_dir")
    if inputs.resume_from is None:
        ckpt = CheckpointManager(out)
        latest = ckpt.latest()
        if latest:
            inputs.resume_from = latest
            inputs.resumed_fingerprint = recorded
        elif ckpt.list(model_only=True):
            log.warning("the checkpoints in %s hold the model only (--save_only_model): "
                        "the run starts from the beginning", out)


def code_of(inputs: Inputs) -> dict:
    """What the Python API gave besides the config, for the run's fingerprint: the names
    of a model of the user's own (its factory) and of their loss, and the digests of the
    datasets given."""
    from raylm.models.custom import factory_name

    spec = inputs.spec
    return {"model_init": spec.config.name if spec.model_init is not None else None,
            "compute_loss_func": factory_name(spec.loss_fn) if spec.loss_fn else None,
            **inputs.given}


def start_output_dir(cfg: TrainConfig, global_batch_size: int,
                     inputs: Optional[Inputs] = None) -> dict:
    """Create (or clear, with --overwrite_output_dir) output_dir and write the run's
    fingerprint in it (``inputs``: the run's model and datasets, part of it: code_of)."""
    out = cfg.output_dir
    if cfg.overwrite_output_dir and os.path.isdir(out):
        for name in ("checkpoints", "metrics.jsonl", "samples.jsonl", RUN_FINGERPRINT,
                     "all_results.json", "eval_results.json", "runs", "metrics.png"):
            p = os.path.join(out, name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    os.makedirs(out, exist_ok=True)
    fingerprint = cfg.run_fingerprint(code_of(inputs) if inputs is not None else None)
    fingerprint["global_batch_size"] = global_batch_size
    tmp = os.path.join(out, RUN_FINGERPRINT + ".tmp")
    with open(tmp, "w") as f:
        json.dump(fingerprint, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out, RUN_FINGERPRINT))
    return fingerprint
