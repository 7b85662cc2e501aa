"""Elastic data parallelism: a rank that dies is dropped, the survivors carry on in
memory in a smaller group, and the run computes the losses of a run that never changed.

Three ranks of a tiny GPT-2 with dropout on (masks per sample: raylm.models.dropout), one
rank killed at a chosen step and phase. Every run checks: per-step losses equal the
uninterrupted run's within 1e-5; every sample of every step trained exactly once (the
sample-id audit); no step redone and nothing restored from disk; the replicas hold equal
parameters and optimizer state after the recovery; nothing left running (the rank
processes, the placement group).
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from raylm import TrainConfig, train
from raylm.runtime import kept
from raylm.runtime.faults import inject
from tests.conftest import TINY_GPT2_DROPOUT
from tests.test_bad_input import assert_fails_before_any_actor

STEPS = 12
FAIL_AT = 4  # committed steps before the failure


def elastic_config(out, corpus, cache_root, **kw) -> TrainConfig:
    base = dict(model_type="gpt2", config_overrides=TINY_GPT2_DROPOUT,
                train_file=[str(corpus)], block_size=32, data_cache_dir=cache_root,
                output_dir=str(out), max_steps=STEPS, save_steps=6, logging_steps=1,
                # 3 x 1.3 of the 4 CPUs: no room for a rank to join (growth is tested
                # on its own below)
                disable_tqdm=True, learning_rate=1e-3, num_workers=3, cpus_per_worker=1.3,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                do_eval=False, log_sample_ids=True)
    base.update(kw)
    return TrainConfig(**base)


def samples_per_step(output_dir) -> dict:
    with open(os.path.join(output_dir, "samples.jsonl")) as f:
        return {r["step"]: sorted(i for ids in r["ranks"] for i in ids)
                for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def unchanged(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("unchanged") / "out"
    result = train(elastic_config(out, corpus_dir, cache_root))
    return {"losses": {h["step"]: h["loss"] for h in result.history},
            "samples": samples_per_step(out)}


class Watch:
    """Kills a rank (SIGKILL by pid) when a step ends, if asked; remembers every rank pid,
    those of the last step, and, at the last step, the ranks' state digests."""

    def __init__(self, kill_rank=None, at_step=None, grow_from=None):
        self.kill_rank, self.at_step, self.grow_from = kill_rank, at_step, grow_from
        self.pids, self.digests, self.killed, self.last = set(), None, None, set()

    def on_step_end(self, driver, step, record):
        import ray

        self.pids.update(driver.worker_pids)
        self.last = set(driver.worker_pids)
        # Look for room to grow at every step boundary from `grow_from` on (the driver
        # looks once a second; these steps take milliseconds).
        driver.grow_check_s = 0.0 if self.grow_from and step >= self.grow_from else 3600.0
        if driver.newcomers is not None:
            # Steps of a real size would cover the newcomers' warm-up: let it finish, so
            # they join at the next boundary.
            warm = driver.newcomers[2]
            ray.wait(warm, num_returns=len(warm), timeout=60)
        if step == self.at_step and self.kill_rank is not None and self.killed is None:
            self.killed = driver.worker_pids[self.kill_rank]
            os.kill(self.killed, signal.SIGKILL)
        if step == STEPS:
            self.digests = driver.state_digests()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["between steps", "between steps, the last rank", "sync",
                                   "update", "commit", "checkpoint"])
def test_a_lost_rank_is_dropped_in_memory_with_the_unchanged_losses(
        phase, unchanged, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """``between steps``: SIGKILL after step FAIL_AT (rank 1; or rank 2, whose ring
    neighbour rank 0 then waits in the next step's first collective on rank 1, which
    failed: rank 1 leaving its group must release it, or rank 0 would be lost too);
    ``sync``: the rank dies while its gradient buckets are being all-reduced; ``update``:
    it dies after the gradient sync, before its step is prepared (either way the step
    commits nowhere and runs again on the survivors); ``commit``: it dies applying
    a step the others apply (the step counts); ``checkpoint``: it dies in the checkpoint
    save after step 6."""
    caplog.set_level("INFO", logger="raylm")
    at = 6 if phase == "checkpoint" else FAIL_AT
    if phase.startswith("between steps"):
        watch, faults = Watch(kill_rank=2 if "last" in phase else 1, at_step=at), ()
    else:
        watch, faults = Watch(), ({"rank": 1, "step": at, "phase": phase},)
    out = tmp_path / "out"
    with inject(*faults):
        result = train(elastic_config(out, corpus_dir, cache_root), callbacks=(watch,))

    assert_shrank_with_the_unchanged_losses(result, out, watch, unchanged, caplog.text)


# Quiet failures (raylm.runtime.health): heartbeats and step deadlines of a test's pace.
WATCH = dict(heartbeat_interval_s=0.3, heartbeat_timeout_s=3.0)


@pytest.mark.slow
@pytest.mark.parametrize("phase,workers", [("step", 3), ("sync", 3), ("commit", 3),
                                           ("update", 2)])
def test_a_frozen_rank_is_ended_and_dropped_in_memory(
        phase, workers, unchanged, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """A rank freezes (SIGSTOP: alive, its sockets open) before its forward, in its
    gradient all-reduce, in its optimizer step (its peers go on into the next step's
    collectives) or after the sync, at dp=3 and at dp=2 (the same global batch): its
    silent heartbeat has it ended, which releases its peers; they carry on in memory with
    the unchanged run's losses, each sample once, and the step past the freeze done
    within a few heartbeat timeouts. The frozen process is gone at the end."""
    caplog.set_level("INFO", logger="raylm")
    watch, out = Watch(), tmp_path / "out"
    ga = {3: 2, 2: 3}[workers]  # (the global batch of 12 either way)
    with inject({"rank": 1, "step": FAIL_AT, "phase": phase, "action": "freeze"}):
        result = train(elastic_config(out, corpus_dir, cache_root, num_workers=workers,
                                      gradient_accumulation_steps=ga, **WATCH),
                       callbacks=(watch,))
    log = caplog.text
    assert "no heartbeat for 3 s (frozen, or its node cut off): rank 1" in log
    assert "ending rank 1 (pid" in log and "last seen in" in log
    assert_shrank_with_the_unchanged_losses(result, out, watch, unchanged, log,
                                            before=workers, after=workers - 1)
    assert max(h["step_time_s"] for h in result.history) < 6 * WATCH["heartbeat_timeout_s"]


@pytest.mark.slow
def test_a_stuck_rank_is_caught_by_the_step_deadline(
        unchanged, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """A rank that answers its heartbeat but makes no progress (it sleeps before its
    forward while its peers wait in the step's collectives) is caught by the step
    deadline (the floor here: the steps take milliseconds), named as the rank furthest
    behind, ended, and the run carries on in memory with the unchanged losses."""
    caplog.set_level("INFO", logger="raylm")
    watch, out = Watch(), tmp_path / "out"
    with inject({"rank": 2, "step": FAIL_AT, "phase": "step", "action": "stall",
                 "seconds": 600}):
        result = train(elastic_config(out, corpus_dir, cache_root, step_deadline_floor_s=3,
                                      **WATCH), callbacks=(watch,))
    log = caplog.text
    assert "the step is past its deadline of 3.0 s" in log
    assert "rank 2 (pid" in log and f"in step {FAIL_AT + 1}: data" in log
    assert "ending rank 2 (pid" in log
    assert_shrank_with_the_unchanged_losses(result, out, watch, unchanged, log)


@pytest.mark.slow
def test_a_straggler_is_named_and_each_step_records_the_slowest_rank(
        unchanged, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """Rank 1 sleeps 0.3 s after its gradient sync in steps 3-8 (its peers wait for it
    in the clip's all-reduce): each of those steps records it as the rank furthest behind,
    and after 4 such steps in a row it is named as a straggler. The run computes the
    unchanged losses."""
    caplog.set_level("INFO", logger="raylm")
    out = tmp_path / "out"
    with inject(*({"rank": 1, "step": s, "phase": "update", "action": "stall",
                   "seconds": 0.3} for s in range(2, 8))):
        result = train(elastic_config(out, corpus_dir, cache_root, straggler_steps=4),
                       callbacks=(Watch(),))
    assert "rank 1 is a straggler" in caplog.text and "4 steps in a row" in caplog.text
    slow = {h["step"]: h for h in result.history if 3 <= h["step"] <= 8}
    assert all(h["slowest_rank"] == 1 and h["slowest_behind_s"] > 0.2
               for h in slow.values()), slow
    assert result.failures == 0
    np.testing.assert_allclose([h["loss"] for h in result.history],
                               [unchanged["losses"][s] for s in range(1, STEPS + 1)],
                               rtol=1e-5)


@pytest.mark.slow
def test_a_straggler_is_replaced_with_a_fresh_rank_on_request(
        unchanged, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """--replace_stragglers: rank 1, slower from step 3, is named a straggler after 4
    steps in a row, ended, and the others carry on in memory; a fresh rank starts in the
    place it left and joins through the growth path. Not a failure; the losses are the
    unchanged run's, every sample once, nothing redone, the replicas equal at the end."""
    caplog.set_level("INFO", logger="raylm")
    watch, out = Watch(grow_from=1), tmp_path / "out"
    with inject(*({"rank": 1, "step": s, "phase": "update", "action": "stall",
                   "seconds": 0.3} for s in range(2, 8))):
        result = train(elastic_config(out, corpus_dir, cache_root, straggler_steps=4,
                                      replace_stragglers=True, cpus_per_worker=1),
                       callbacks=(watch,))
    log = caplog.text
    assert "rank 1 is a straggler" in log and "replacing rank 1 (pid" in log
    assert "ending rank 1 (pid" in log and "a straggler replaced at step 7" in log
    assert "shrank in memory to 2 rank(s)" in log and "grew in memory to 3 rank(s)" in log
    assert "0 committed steps redone" in log and "restoring" not in log
    assert result.failures == 0
    sizes = [h["world_size"] for h in result.history]
    assert sizes[:6] == [3] * 6 and 2 in sizes and sizes[-1] == 3, sizes
    np.testing.assert_allclose([h["loss"] for h in result.history],
                               [unchanged["losses"][s] for s in range(1, STEPS + 1)],
                               rtol=1e-5)
    assert samples_per_step(out) == unchanged["samples"]
    assert watch.digests is not None and len(watch.digests) == 3
    assert len(set(watch.digests)) == 1
    assert_nothing_left(watch)


def assert_shrank_with_the_unchanged_losses(result, out, watch, unchanged, log: str,
                                            before: int = 3, after: int = 2) -> None:
    assert result.failures == 1
    assert f"shrank in memory to {after} rank(s)" in log
    assert "0 committed steps redone" in log and "restoring" not in log
    steps = list(range(1, STEPS + 1))
    losses = {h["step"]: h["loss"] for h in result.history}
    assert sorted(losses) == steps
    np.testing.assert_allclose([losses[s] for s in steps],
                               [unchanged["losses"][s] for s in steps], rtol=1e-5)
    sizes = [h["world_size"] for h in result.history]
    assert sizes[0] == before and sizes[-1] == after
    # Every committed step trained exactly the unchanged run's samples, once each.
    assert samples_per_step(out) == unchanged["samples"]
    for ids in unchanged["samples"].values():
        assert len(ids) == len(set(ids))
    # The two replicas left agree to the bit.
    assert watch.digests is not None and len(set(watch.digests)) == 1
    assert_nothing_left(watch)


def assert_nothing_left(watch) -> None:
    """The run's rank processes and placement groups are gone, but for the ranks of its
    last step that it kept for the next run (conftest's raylm.keep_ranks), which hold
    its placement groups."""
    import ray

    ranks = kept.current()
    alive = {i["pid"] for i in ray.get([a.info.remote() for a in ranks.actors])} \
        if ranks else set()
    deadline = time.time() + 20
    left = lambda: [p for p in watch.pids - alive if not _gone(p)]  # noqa: E731
    while left() and time.time() < deadline:
        time.sleep(0.2)
    assert not left(), left()
    assert alive <= watch.last, (alive, watch.last)
    held = {pg.id.hex() for pg in ranks.pgs} if ranks else set()
    states = {k: t["state"] for k, t in ray.util.placement_group_table().items()}
    assert {k for k, v in states.items() if v != "REMOVED"} <= held, states


@pytest.mark.slow
def test_a_rank_lost_then_room_again_shrinks_and_grows_back(
        unchanged, ray_cluster, corpus_dir, cache_root, tmp_path, caplog):
    """3 ranks of 1 CPU on 4: a rank killed after step 3; the two survivors carry on in
    memory; the free CPU lets a new rank start, warm up while training goes on, and join
    at a step boundary with a live replica's state. The losses are the unchanged run's
    throughout, every sample once, the three replicas equal at the end."""
    caplog.set_level("INFO", logger="raylm")
    watch = Watch(kill_rank=1, at_step=3, grow_from=4)
    out = tmp_path / "out"
    result = train(elastic_config(out, corpus_dir, cache_root, cpus_per_worker=1),
                   callbacks=(watch,))
    log = caplog.text
    assert "shrank in memory to 2 rank(s)" in log
    assert "grew in memory to 3 rank(s)" in log and "restoring" not in log
    sizes = [h["world_size"] for h in result.history]
    assert sizes[:3] == [3, 3, 3] and 2 in sizes and sizes[-1] == 3, sizes
    losses = [h["loss"] for h in result.history]
    np.testing.assert_allclose(losses, [unchanged["losses"][s] for s in range(1, STEPS + 1)],
                               rtol=1e-5)
    assert samples_per_step(out) == unchanged["samples"]
    assert watch.digests is not None and len(watch.digests) == 3
    assert len(set(watch.digests)) == 1
    assert_nothing_left(watch)


@pytest.mark.parametrize("kw,message", [
    (dict(min_workers=3, max_workers=2), "--min_workers 3 is more than --max_workers 2"),
    (dict(num_workers=1, min_workers=2), "--num_workers 1 is below --min_workers 2"),
    (dict(num_workers=4, max_workers=2), "--num_workers 4 is above --max_workers 2"),
    (dict(tp=2, num_workers=4, min_workers=3),
     "--min_workers 3 is not a whole number of pp x tp = 2-rank replicas"),
    (dict(dp=2, num_workers=2, max_workers=4), "--dp fixes the data-parallel degree"),
    (dict(min_workers=-1), "--min_workers must be >= 0"),
    # The shared test cluster has one node: nowhere to keep a copy off each rank's node.
    (dict(snapshot_steps=2), "--snapshot_steps 2: a rank's snapshot is kept on its own node "
     "and on another one, and this cluster has a single node"),
    (dict(snapshot_steps=-1), "--snapshot_steps must be >= 0"),
    (dict(heartbeat_interval_s=5, heartbeat_timeout_s=5),
     "--heartbeat_interval_s 5 must be below --heartbeat_timeout_s 5"),
    (dict(step_deadline_floor_s=0), "--step_deadline_floor_s must be > 0"),
    (dict(step_deadline_factor=1), "--step_deadline_factor must be > 1"),
    (dict(straggler_factor=0.5), "--straggler_factor must be > 1"),
])
def test_elastic_bounds_errors_before_any_actor(kw, message, ray_cluster, tmp_path,
                                                corpus_dir, cache_root):
    assert_fails_before_any_actor(message, tmp_path, corpus_dir, cache_root,
                                  cpus_per_worker=0.5, **kw)


def test_every_generation_meets_at_the_drivers_store_over_one_kept_connection():
    """The group's rendezvous is a TCPStore in the driver, one for the group's life
    (WorkerGroup.rendezvous); a rank connects to it once and keeps the connection for
    every later generation (RankWorker._store), so a regroup opens none. Called on a
    bare namespace: a RankWorker in this process would set its threads."""
    from datetime import timedelta
    from types import SimpleNamespace

    from raylm.runtime.group import WorkerGroup
    from raylm.runtime.worker import RankWorker

    group = WorkerGroup(collective_timeout_s=30, huge_pages=False)
    master = group.rendezvous()
    assert group.rendezvous() == master  # (the next generation's: the same store)
    rank = SimpleNamespace(store=None)
    client = RankWorker._store(rank, master, timedelta(seconds=2))
    assert RankWorker._store(rank, master, timedelta(seconds=2)) is client
    client.set("from-rank", b"1")
    assert group.store.get("from-rank") == b"1"
    group.stop()  # (a new run's group opens a new store: the rank connects to that one)
    other = WorkerGroup(collective_timeout_s=30, huge_pages=False)
    assert RankWorker._store(rank, other.rendezvous(), timedelta(seconds=2)) is not client
    other.stop()
