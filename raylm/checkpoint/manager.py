"""Checkpoint directories: atomic commit, discovery, rotation (driver side).

Layout: ``<output_dir>/checkpoints/step-00000010/`` holding the distributed checkpoint
of model and optimizer (torch.distributed.checkpoint), one RNG file per rank and
``trainer_state.json`` (with --save_only_model: a Hugging Face model directory and
``trainer_state.json`` marked ``model_only``, which no run restores). A checkpoint counts
only once its ``trainer_state.json`` exists, written by the driver when every rank has
finished. On a local disk the ranks write into a hidden ``.tmp-*`` directory that is then
renamed to its ``step-*`` name (one rename(2)); an object store has no rename, so there
the ranks write under the ``step-*`` name itself and ``trainer_state.json``, one object
written last, is the commit (a step saved again goes to ``step-*.N``, and the older save
of it is discarded only once the new one is committed). A crash leaves a ``.tmp-*``
directory or a ``step-*`` one without it: never loaded, and cleared by the next run. A
checkpoint is discarded marker first, for the same reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Optional

from raylm import storage

# step-00000010, and in an object store step-00000010.N for the N-th save of a step again
STEP_DIR = re.compile(r"^step-(\d{8})(?:\.(\d+))?$")
TRAINER_STATE = "trainer_state.json"


class CheckpointManager:
    def __init__(self, output_dir: str):
        self.root = storage.join(storage.local_path(output_dir), "checkpoints")
        self.remote = storage.is_remote(output_dir)

    def path_for(self, step: int) -> str:
        """The committed checkpoint of ``step`` (or where it would be)."""
        return self._saves(step).get("committed") or \
            storage.join(self.root, f"step-{step:08d}")

    def _saves(self, step: Optional[int] = None) -> dict:
        """Each step's saves: {"committed": the newest committed one's path, "all":
        [(attempt, path, committed)]}; of ``step`` alone when given."""
        steps: dict = {}
        for name in storage.listdir(self.root):
            m = STEP_DIR.match(name)
            if not m or (step is not None and int(m.group(1)) != step):
                continue
            path = storage.join(self.root, name)
            done = storage.isfile(storage.join(path, TRAINER_STATE))
            steps.setdefault(int(m.group(1)), []).append((int(m.group(2) or 0), path, done))
        out = {}
        for s, saves in steps.items():
            committed = [path for _, path, done in sorted(saves) if done]
            out[s] = {"committed": committed[-1] if committed else None, "all": saves}
        return out.get(step, {}) if step is not None else out

    def list(self, model_only: Optional[bool] = None) -> list[tuple[int, str]]:
        """Committed checkpoints, oldest first: all, or those that hold the model alone
        (``model_only=True``: --save_only_model) or the whole state (False)."""
        found = []
        for step, saves in self._saves().items():
            path = saves["committed"]
            if path and (model_only is None or bool(
                    read_trainer_state(path).get("model_only")) == model_only):
                found.append((step, path))
        return sorted(found)

    def latest(self) -> Optional[str]:
        """The newest checkpoint a run can restore (not a model-only one)."""
        found = self.list(model_only=False)
        return found[-1][1] if found else None

    def clear_partial(self) -> None:
        """Remove what crashed saves left behind: saves never committed (and in an
        object store the older saves of a step saved again)."""
        if self.remote:
            for saves in self._saves().values():
                for _, path, _ in saves["all"]:
                    if path != saves["committed"]:
                        self._discard(path)
            return
        for name in storage.listdir(self.root):
            if name.startswith(".tmp-") or name.startswith(".trash-"):
                shutil.rmtree(storage.join(self.root, name), ignore_errors=True)

    def begin(self, step: int) -> str:
        """A fresh directory for the ranks to write step ``step`` into."""
        if self.remote:  # (written in place: the marker commits it)
            # The same step saved again (a run resumed from an earlier checkpoint) goes
            # beside the older save, which stays until this one is committed.
            attempt = 1 + max((a for a, _, _ in self._saves(step).get("all", [])),
                              default=-1)
            return storage.join(self.root, f"step-{step:08d}"
                                + (f".{attempt}" if attempt else ""))
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        return tmp

    def commit(self, tmp: str, step: int, trainer_state: dict) -> str:
        data = json.dumps(trainer_state, indent=2).encode()
        if self.remote:
            storage.write_bytes(storage.join(tmp, TRAINER_STATE), data)
            for _, path, _ in self._saves(step)["all"]:
                if path != tmp:  # (an older save of the same step)
                    self._discard(path)
            return tmp
        with open(os.path.join(tmp, TRAINER_STATE), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        final = os.path.join(self.root, f"step-{step:08d}")  # (no listing: one name)
        if os.path.exists(final):  # the same step saved again after a recovery
            self._discard(final)
        os.rename(tmp, final)
        return final

    def rotate(self, keep: Optional[int], protect: Optional[str] = None) -> None:
        """Keep the newest ``keep`` checkpoints, and ``protect`` (the best one, as the
        Trainer keeps it) besides."""
        if not keep or keep <= 0:
            return
        for _, path in self.list()[:-keep]:
            if path != protect:
                self._discard(path)

    def _discard(self, path: str) -> None:
        if self.remote:  # the marker first: never a partial directory that counts
            storage.delete(storage.join(path, TRAINER_STATE))
            storage.delete(path)
            return
        if not os.path.exists(path):
            return
        # Rename first so that a crash during the delete cannot leave a partial
        # directory under a committed name.
        trash = os.path.join(self.root, f".trash-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def read_trainer_state(checkpoint_dir: str) -> dict:
    return json.loads(storage.read_bytes(storage.join(checkpoint_dir, TRAINER_STATE)))
