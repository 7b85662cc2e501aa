"""What the checks and the data preparation hand the driver: ``Inputs`` (check_inputs) and
``Data`` (prepare_data); and stopping kept ranks, which both do to free CPUs for Ray Data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class Inputs:
    """What check_inputs found: the model, the data to read, the run to resume."""

    spec: object  # ModelSpec
    block_size: int
    train_files: list
    eval_files: list
    # With several --validation_file: each eval file's set name (eval_<name>_loss)
    eval_names: list = field(default_factory=list)
    resume_from: Optional[str] = None  # checkpoint directory
    streaming: bool = False  # the training data is streamed (streams())
    resumed_fingerprint: Optional[dict] = None  # of the run being resumed
    # --task image-classification: (training ImageFolder, validation ImageFolder or None)
    images: Optional[tuple] = None
    # train(train_dataset=, eval_dataset=): each one's digest (raylm.data.given), part of
    # the run's fingerprint
    given: dict = field(default_factory=dict)


@dataclass
class Data:
    """What prepare_data built: the datasets (or stream) and the sample ids of each set."""

    train: object  # TokenizedDataset (None when not training)
    eval: object  # TokenizedDataset the eval ids index into (None: no eval)
    train_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    eval_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # Several validation sets: [(name, ids)], reported each and together (eval_ids)
    eval_sets: list = field(default_factory=list)
    stream: object = None  # --streaming: the TokenStream (train is then its StreamSpec)


def room_for_tasks() -> None:
    """Before Ray Data's tasks tokenize, decode or read a dataset given to train(): rank
    processes kept from an earlier run (raylm.keep_ranks) are stopped if they leave no
    CPU for those tasks."""
    import ray

    from raylm.runtime import kept

    if ray.is_initialized() and not kept.room_for_tasks():
        kept.release()
