"""What the driver decides when a rank fails or the cluster cannot hold the plan: small
objects that return decisions, as Ray Train v2 separates its failure and scaling policies
from its controller. The driver carries the decisions out (tear down, restore, start);
an elastic runtime swaps these objects, not the driver's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from raylm.plan.layout import Plan


@dataclass(frozen=True)
class FailureDecision:
    restart: bool  # False: give up and raise
    reason: str


@dataclass(frozen=True)
class FailurePolicy:
    """Restart from the latest checkpoint after a rank failure, up to ``max_failures``
    times in a run; then give up."""

    max_failures: int

    def decide(self, failures: int, error: str) -> FailureDecision:
        """``failures``: how many the run has had, this one included."""
        if failures > self.max_failures:
            return FailureDecision(False, f"{failures} failure(s), more than --max_failures "
                                          f"{self.max_failures}; last: {error}")
        return FailureDecision(True, f"failure {failures} of at most {self.max_failures}")


@dataclass(frozen=True)
class ScalingPolicy:
    """How many ranks to run: as many as the live cluster holds, in whole data-parallel
    replicas, never more than the run started with (``target``: joining nodes are not
    used yet). The global batch stays the run's (Plan.resized)."""

    target: int
    min_workers: int = 0
    max_workers: int = 0

    def after_failure(self, plan: Plan, live_ranks: int) -> Plan:
        """The plan for the group restarted on a cluster that holds ``live_ranks``."""
        n = min(self.target, live_ranks)
        return plan.resized(n) if n != plan.world_size else plan

    def shrink_to(self, plan: Plan, survivors: int) -> Optional[int]:
        """After a failure, how many of ``survivors`` ranks to carry on with in memory:
        whole replicas, at least ``min_workers``; None when they cannot carry on."""
        n = min(survivors, self.target)
        n -= n % plan.dims.replica_size
        if n < max(1, self.min_workers):
            return None
        return n

    def grow_to(self, plan: Plan, capacity: int) -> Optional[int]:
        """With room for ``capacity`` ranks on the cluster: how many to grow to (whole
        replicas, at most ``max_workers``, else the run's start size); None when the
        group is as large as it may be or the room is less than a replica."""
        ceiling = self.max_workers or self.target
        n = min(capacity, ceiling)
        n -= n % plan.dims.replica_size
        return n if n > plan.world_size else None

    def fewer(self, plan: Plan, tried: int) -> Optional[int]:
        """``tried`` ranks could not be placed: the next size to try (one replica fewer),
        or None when not even one rank could be."""
        if tried <= 1:
            return None
        return max(1, tried - plan.dims.replica_size)


@dataclass
class RunRecord:
    """Where a run is: the driver's progress, in one place, from its start."""

    plan: Optional[Plan] = None  # the layout the rank group runs now
    step: int = 0  # optimizer steps done
    checkpoint: Optional[str] = None  # the latest committed checkpoint
    failures: int = 0
    history: list = field(default_factory=list)  # one dict per optimizer step
    # --step_protocol ranks: (the StepTable, its plan) of the step the survivors of a
    # failure committed and the driver had not recorded (rank 0's answer lost with it)
    lost_answer: Optional[Any] = None
