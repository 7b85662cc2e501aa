"""The driver's decisions as objects: what a failure and a smaller cluster mean."""

from __future__ import annotations

import pytest

from raylm.errors import ConfigError
from raylm.plan.dims import ParallelDims
from raylm.plan.layout import Plan
from raylm.runtime.policy import FailurePolicy, RunRecord, ScalingPolicy


def plan(dp=4, pp=1, tp=1) -> Plan:
    return Plan(dims=ParallelDims(dp=dp, pp=pp, tp=tp), micro_batch_size=2,
                global_batch_size=16, cpus_per_worker=0.5)


def test_failures_restart_until_the_limit():
    policy = FailurePolicy(max_failures=2)
    first, second, third = (policy.decide(n, "rank 1 died") for n in (1, 2, 3))
    assert first.restart and first.reason == "failure 1 of at most 2"
    assert second.restart
    assert not third.restart
    assert third.reason == "3 failure(s), more than --max_failures 2; last: rank 1 died"
    assert not FailurePolicy(max_failures=0).decide(1, "x").restart


def test_a_smaller_cluster_keeps_whole_replicas_and_the_global_batch():
    policy = ScalingPolicy(target=8)
    p = plan(dp=2, pp=2, tp=2)
    assert policy.after_failure(p, 8) is p  # nothing lost: the same plan
    shrunk = policy.after_failure(p, 7)  # a rank short: one replica fewer
    assert shrunk.dims == ParallelDims(dp=1, pp=2, tp=2)
    assert shrunk.global_batch_size == 16 and shrunk.micro_batches_per_rank == 8
    assert policy.after_failure(p, 64) is p  # never more than the run started with
    with pytest.raises(ConfigError, match="cannot hold one pp=2 x tp=2 replica"):
        policy.after_failure(p, 3)


def test_placement_retries_one_replica_fewer():
    policy = ScalingPolicy(target=8)
    assert policy.fewer(plan(dp=2, pp=2, tp=2), 8) == 4
    assert policy.fewer(plan(dp=4), 4) == 3
    assert policy.fewer(plan(dp=4), 1) is None


def test_run_record_starts_empty():
    run = RunRecord()
    assert (run.step, run.plan, run.checkpoint, run.failures,
            run.history) == (0, None, None, 0, [])


def test_survivors_carry_on_in_whole_replicas_within_the_bounds():
    assert ScalingPolicy(target=4).shrink_to(plan(dp=4), 3) == 3
    assert ScalingPolicy(target=4).shrink_to(plan(dp=4), 0) is None
    # pp=2 x tp=2 replicas: 7 survivors carry on as one replica of 4.
    assert ScalingPolicy(target=8).shrink_to(plan(dp=2, pp=2, tp=2), 7) == 4
    assert ScalingPolicy(target=8).shrink_to(plan(dp=2, pp=2, tp=2), 3) is None
    # --min_workers: fewer survivors than the bound do not carry on alone.
    assert ScalingPolicy(target=4, min_workers=3).shrink_to(plan(dp=4), 2) is None
    assert ScalingPolicy(target=4, min_workers=3).shrink_to(plan(dp=4), 3) == 3
