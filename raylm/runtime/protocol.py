"""The step protocol between the driver and its ranks: what a step asks of a rank, what the
rank answers, and the commit that applies a step once every rank has prepared it.

A step is prepared on every rank (forward, backward, gradient sync, clip) and then
committed (optimizer, schedule): a step that fails on any rank is committed on none
(torchft's should_commit, decided by the driver). The commit rides on the next step's
request, one Ray call per rank and step, or goes on its own (``PendingCommit``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np


@dataclass
class StepRequest:
    """One rank's part of a step: prepare the step after ``step`` committed ones."""
    step: int
    micro_batch_ids: list  # this rank's replica's micro-batches, as lists of sample ids
    next_ids: Optional[list]  # the next step's, to prefetch (None: the run's last step)
    loss_scale: float = 1.0  # fp16's (raylm.runtime.precision); 1.0 otherwise
    blocks: Optional[list] = None  # --streaming: the Ray Data blocks both steps read
    generation: int = 0  # the process group's generation (a call for another is refused)
    commit: Optional[int] = None  # the step before, applied first (PendingCommit.take)


@dataclass
class StepResult:
    """What a rank answers for a prepared step: scalars only."""
    loss: float  # the step's mean loss over every label token of the global batch
    tokens: int  # the global batch's label tokens
    local_tokens: int  # this rank's
    has_loss: bool  # this rank computes the loss (under a pipeline, a last stage)
    learning_rate: float  # the step will use
    grad_norm: float  # before clipping
    overflow: bool  # fp16's gradients overflowed: the commit skips the optimizer
    peak_rss_bytes: int  # the rank process's peak resident memory so far
    # Where the step's time went, in seconds (raylm.runtime.profiling.BREAKDOWN)
    data_wait_s: float
    forward_backward_s: float
    grad_sync_s: float
    clip_s: float
    optimizer_s: Optional[float]  # the last commit's (None before the first)
    step_s: float
    boundary_idle_s: Optional[float]  # idle since the last answer (None: the first step)
    # Waiting on the other ranks: the token count, the exposed gradient sync, the clip's
    # all-reduce (step_s less this: the rank's own work, raylm.runtime.health.Stragglers)
    peer_wait_s: float = 0.0
    snapshot_s: float = 0.0  # what --snapshot_steps cost this rank since the last step
    memory: Optional[dict] = None  # what the rank holds, on the step that measures it
    sample_ids: Optional[list] = None  # --log_sample_ids: the replica's samples


@dataclass
class EvalResult:
    """A rank's evaluation of its share of a validation set, reduced over dp."""
    eval_loss: float
    perplexity: float
    eval_tokens: int
    has_loss: bool
    eval_correct: Optional[int] = None  # top-1 hits (image classification)


class PendingCommit:
    """The step every rank prepared whose commit is not sent yet. The next step's
    requests take it (``take``); anything else that reaches the ranks first sends it on
    its own (raylm.runtime.group.WorkerGroup.flush), so no caller has to remember it."""

    def __init__(self):
        self.step: Optional[int] = None

    def decide(self, step: int) -> None:
        """Every rank prepared ``step``: it is to be committed."""
        if self.step is not None:
            raise RuntimeError(f"step {self.step} was never sent for commit")
        self.step = step

    def take(self) -> Optional[int]:
        """The step to commit (None when none is pending); it is no longer pending."""
        step, self.step = self.step, None
        return step


@dataclass
class WindowRequest:
    """Steps ``first`` .. ``last`` - 1 (0-based), run by the ranks on their own
    (--step_protocol ranks): each derives its micro-batches from ``sampler`` and the step
    number, and the ranks agree each step's commit among themselves (``StepTable``)."""
    first: int
    last: int
    steps: int  # the run's last step (the next step's ids are prefetched before it)
    sampler: Any  # an ObjectRef of the run's GlobalBatchSampler (fetched once per rank)
    generation: int = 0
    commit: Optional[int] = None  # a step the driver's last call left to commit


# The numbers of a StepResult that the ranks gather each step (--step_protocol ranks),
# one row per rank; None is NaN. ``speaks``: the rank speaks for its replica's samples.
COLUMNS = ("loss", "tokens", "local_tokens", "has_loss", "learning_rate", "grad_norm",
           "overflow", "peak_rss_bytes", "data_wait_s", "forward_backward_s",
           "grad_sync_s", "clip_s", "optimizer_s", "step_s", "boundary_idle_s",
           "peer_wait_s", "snapshot_s", "stop", "speaks")
_COL = {name: i for i, name in enumerate(COLUMNS)}
_INT = ("tokens", "local_tokens", "peak_rss_bytes")
_BOOL = ("has_loss", "overflow")
_OPTIONAL = ("optimizer_s", "boundary_idle_s")  # NaN in the table is None (a NaN loss stays)


class StepTable:
    """Every rank's answer for one step as columns (one row per rank): what the driver
    reads from a step, in array operations rather than a loop over ranks."""

    def __init__(self, values: np.ndarray, memory: Optional[list] = None,
                 sample_ids: Optional[list] = None):
        self.values = values  # (ranks, len(COLUMNS)) float64
        self.memory = memory  # each rank's StepResult.memory, on the step that measures
        self.sample_ids = sample_ids  # --log_sample_ids: each replica's, in rank order

    @staticmethod
    def row(r: StepResult, stop: bool = False, speaks: bool = False) -> list:
        """One rank's row."""
        return [np.nan if v is None else float(v) for v in
                [getattr(r, name) for name in COLUMNS[:-2]] + [stop, speaks]]

    @classmethod
    def of(cls, results: list) -> "StepTable":
        """The table of the ranks' StepResults (the driver's own calls)."""
        memory = [r.memory for r in results] if results[0].memory is not None else None
        return cls(np.array([cls.row(r) for r in results], dtype=np.float64), memory,
                   [r.sample_ids for r in results if r.sample_ids is not None])

    def __len__(self) -> int:
        return len(self.values)

    def col(self, name: str) -> np.ndarray:
        return self.values[:, _COL[name]]

    def least(self, name: str) -> Optional[float]:
        """The smallest of column ``name`` that is not NaN (None when none is)."""
        values = self.col(name)
        return None if np.isnan(values).all() else float(np.nanmin(values))

    def loss_row(self) -> StepResult:
        """The answer of a rank that computed the loss (under a pipeline, a last stage)."""
        has = np.flatnonzero(self.col("has_loss") > 0)
        return self.result(int(has[0]) if len(has) else 0)

    def result(self, i: int) -> StepResult:
        """Rank ``i``'s row as a StepResult."""
        v = self.values[i]
        kw = {}
        for f in fields(StepResult):
            if f.name not in _COL:
                continue
            x = v[_COL[f.name]]
            kw[f.name] = (None if f.name in _OPTIONAL and np.isnan(x) else
                          int(x) if f.name in _INT else
                          bool(x) if f.name in _BOOL else float(x))
        return StepResult(**kw)


def loss_result(results: list):
    """The result of a rank that computed the loss (under a pipeline, a last stage)."""
    return next((r for r in results if r.has_loss), results[0])
