"""The step protocol between the driver and its ranks: what a step asks of a rank, what the
rank answers, and the commit that applies a step once every rank has prepared it.

A step is prepared on every rank (forward, backward, gradient sync, clip) and then
committed (optimizer, schedule): a step that fails on any rank is committed on none
(torchft's should_commit, decided by the driver). The commit rides on the next step's
request, one Ray call per rank and step, or goes on its own (``PendingCommit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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


def loss_result(results: list):
    """The result of a rank that computed the loss (under a pipeline, a last stage)."""
    return next((r for r in results if r.has_loss), results[0])
