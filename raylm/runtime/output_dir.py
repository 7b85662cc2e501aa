"""The output directory: fresh, the same run's to resume, or an error (decided before
anything starts); the run's fingerprint file written in it when the run starts; and,
for an object-store --output_dir, the driver's local stage of its own files (OutputDir).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from typing import Optional

from raylm import storage
from raylm.checkpoint.manager import TRAINER_STATE, CheckpointManager, read_trainer_state
from raylm.config import TrainConfig
from raylm.errors import ConfigError
from raylm.runtime.inputs import Inputs

log = logging.getLogger("raylm")
# The run's fingerprint (TrainConfig.run_fingerprint): a re-run in the same output_dir
# with other settings is refused.
RUN_FINGERPRINT = "raylm_run.json"


def decide_output_dir(cfg: TrainConfig, inputs: Inputs) -> None:
    """Fresh, resumable (same run), or an error: decided before anything starts."""
    if not cfg.sync_interval_s > 0:
        raise ConfigError(f"--sync_interval_s must be > 0 (got {cfg.sync_interval_s:g})")
    out = storage.local_path(str(cfg.output_dir))
    if storage.is_remote(out):
        try:  # a scheme with a file system, a bucket that is there and takes writes
            probe = storage.join(out, ".raylm-write-check")
            storage.write_bytes(probe, b"")
            storage.delete(probe)
        except (OSError, ConfigError) as e:
            raise ConfigError(
                f"--output_dir {out}: cannot write there ({' '.join(str(e).split())}); "
                "check the bucket, the endpoint and the credentials (as the AWS and GCS "
                "libraries read them from the environment, or in the URI's query)") from None
    try:
        _decide(cfg, inputs, out)
    except OSError as e:  # (an object store that stopped answering)
        raise ConfigError(f"--output_dir {out}: cannot read it: "
                          f"{' '.join(str(e).split())}") from None


def _decide(cfg: TrainConfig, inputs: Inputs, out: str) -> None:
    if cfg.resume_from_checkpoint:
        resume = storage.local_path(cfg.resume_from_checkpoint)
        if not storage.isfile(storage.join(resume, TRAINER_STATE)):
            raise ConfigError(f"--resume_from_checkpoint: {cfg.resume_from_checkpoint} is not "
                              "a raylm checkpoint (no trainer_state.json)")
        if read_trainer_state(resume).get("model_only"):
            raise ConfigError(f"--resume_from_checkpoint: {cfg.resume_from_checkpoint} holds "
                              "the model only (--save_only_model): no optimizer state to "
                              "resume; fine-tune from it with --model_name_or_path instead")
        inputs.resume_from = resume
        inputs.resumed_fingerprint = read_trainer_state(resume).get("run")
    if not storage.listdir(out):
        return
    if cfg.overwrite_output_dir:
        return  # cleared in start_output_dir, once the run really starts
    fingerprint_path = storage.join(out, RUN_FINGERPRINT)
    if not storage.isfile(fingerprint_path):
        raise ConfigError(f"--output_dir {out} already exists and is not empty; use "
                          "--overwrite_output_dir to train over it")
    recorded = json.loads(storage.read_bytes(fingerprint_path))
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


# What --overwrite_output_dir clears (the model's files are overwritten by the new run's).
RUN_FILES = ("checkpoints", "metrics.jsonl", "samples.jsonl", RUN_FINGERPRINT,
             "all_results.json", "eval_results.json", "runs", "metrics.png")


def start_output_dir(cfg: TrainConfig, out: "OutputDir", global_batch_size: int,
                     inputs: Optional[Inputs] = None) -> dict:
    """Create (or clear, with --overwrite_output_dir) output_dir and write the run's
    fingerprint in it (``inputs``: the run's model and datasets, part of it: code_of)."""
    if cfg.overwrite_output_dir:
        for name in RUN_FILES:
            storage.delete(storage.join(out.dest, name))
    else:
        out.fetch()  # (a resumed run's metrics go on from the bucket's)
    os.makedirs(out.local, exist_ok=True)
    fingerprint = cfg.run_fingerprint(code_of(inputs) if inputs is not None else None)
    fingerprint["global_batch_size"] = global_batch_size
    tmp = os.path.join(out.local, RUN_FINGERPRINT + ".tmp")
    with open(tmp, "w") as f:
        json.dump(fingerprint, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out.local, RUN_FINGERPRINT))
    out.sync()
    return fingerprint


class OutputDir:
    """Where a run's outputs go. ``dest``: --output_dir, a local path or an object-store
    URI; the ranks write the model and checkpoints there directly. ``local``: where the
    driver writes its own files (metrics.jsonl, the run record, TensorBoard's events,
    all_results.json): ``dest`` itself, or for an object store a local stage uploaded
    every --sync_interval_s seconds, after each checkpoint and at the end (a driver that
    dies loses at most the last interval's lines)."""

    def __init__(self, dest: str, sync_interval_s: float = 30.0):
        self.dest = storage.local_path(dest)
        self.remote = storage.is_remote(dest)
        self.local = (tempfile.mkdtemp(prefix="raylm-output-") if self.remote
                      else self.dest)
        self.interval = sync_interval_s
        self._sent: dict = {}  # relative path -> (size, mtime) as last uploaded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def fetch(self) -> None:
        """The driver's files a run before left in the object store, into the stage."""
        if not self.remote:
            return
        for name in storage.listdir(self.dest):
            if name in RUN_FILES and name not in ("checkpoints", "metrics.png"):
                src, dst = storage.join(self.dest, name), os.path.join(self.local, name)
                if storage.isfile(src):
                    with open(dst, "wb") as f:
                        f.write(storage.read_bytes(src))
                else:
                    storage.download_dir(src, dst)
        self._sent = self._changed({})

    def start(self) -> None:
        """Upload the stage every interval, in a thread of its own, until ``close``."""
        if self.remote and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="raylm-output-sync",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sync(strict=False)  # (the next interval tries again)

    def sync(self, strict: bool = True) -> None:
        """Upload the stage's files that changed since the last upload (``strict``:
        a failure raises, else it is logged)."""
        if not self.remote:
            return
        try:
            with self._lock:
                for rel, stat in self._changed(self._sent).items():
                    if self._upload(rel):
                        self._sent[rel] = stat
        except Exception as e:
            if strict:
                raise
            log.warning("could not upload to %s: %s", storage.shown(self.dest), e)

    def _upload(self, rel: str) -> bool:
        """One file of the stage into the object store; a .jsonl up to its last whole
        line (the driver may be appending). False when it went meanwhile."""
        dest = storage.join(self.dest, *rel.split(os.sep))
        try:
            with open(os.path.join(self.local, rel), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return False
        if rel.endswith(".jsonl"):
            data = data[:data.rfind(b"\n") + 1]
        storage.write_bytes(dest, data)
        return True

    def _changed(self, sent: dict) -> dict:
        found = {}
        for root, _, files in os.walk(self.local):
            for name in files:
                if ".tmp" in name:  # (written under a temporary name, then renamed)
                    continue
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                rel = os.path.relpath(path, self.local)
                if sent.get(rel) != (st.st_size, st.st_mtime_ns):
                    found[rel] = (st.st_size, st.st_mtime_ns)
        return found

    def close(self, strict: bool = False) -> None:
        """The last upload; the stage removed once it is all in the object store.
        ``strict``: a failed upload raises (a run that finished), else it is logged."""
        if not self.remote:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.sync()
        except Exception as e:
            message = (f"could not upload the run's files to {storage.shown(self.dest)} "
                       f"({e}); they are in {self.local}")
            if strict:
                raise OSError(message) from e
            log.warning("%s", message)  # (a failed run's own error comes first)
            return
        shutil.rmtree(self.local, ignore_errors=True)
