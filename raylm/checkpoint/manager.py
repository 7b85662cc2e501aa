"""Checkpoint directories: atomic commit, discovery, rotation (driver side).

Layout: ``<output_dir>/checkpoints/step-00000010/`` holding the distributed checkpoint
of model and optimizer (torch.distributed.checkpoint), one RNG file per rank and
``trainer_state.json`` (with --save_only_model: a Hugging Face model directory and
``trainer_state.json`` marked ``model_only``, which no run restores). Ranks write into a hidden ``.tmp-*`` directory; only when every
rank has finished does the driver rename it to its ``step-*`` name. A rename is atomic on
POSIX file systems, so a crash leaves at worst a ``.tmp-*`` directory, which is never
loaded (and is cleared by the next run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Optional

STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer_state.json"


class CheckpointManager:
    def __init__(self, output_dir: str):
        self.root = os.path.join(os.path.abspath(output_dir), "checkpoints")

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step:08d}")

    def list(self, model_only: Optional[bool] = None) -> list[tuple[int, str]]:
        """Committed checkpoints, oldest first: all, or those that hold the model alone
        (``model_only=True``: --save_only_model) or the whole state (False)."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            m = STEP_DIR.match(name)
            path = os.path.join(self.root, name)
            if m and os.path.isfile(os.path.join(path, TRAINER_STATE)):
                if model_only is None or \
                        bool(read_trainer_state(path).get("model_only")) == model_only:
                    found.append((int(m.group(1)), path))
        return sorted(found)

    def latest(self) -> Optional[str]:
        """The newest checkpoint a run can restore (not a model-only one)."""
        found = self.list(model_only=False)
        return found[-1][1] if found else None

    def clear_partial(self) -> None:
        """Remove what crashed saves left behind."""
        if os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".tmp-") or name.startswith(".trash-"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def begin(self, step: int) -> str:
        """A fresh temporary directory for the ranks to write step ``step`` into."""
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        return tmp

    def commit(self, tmp: str, step: int, trainer_state: dict) -> str:
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump(trainer_state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        final = self.path_for(step)
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
        # Rename first so that a crash during the delete cannot leave a partial
        # directory under a committed name.
        trash = os.path.join(self.root, f".trash-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def read_trainer_state(checkpoint_dir: str) -> dict:
    with open(os.path.join(checkpoint_dir, TRAINER_STATE)) as f:
        return json.load(f)
