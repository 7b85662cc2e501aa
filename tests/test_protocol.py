"""The step protocol (raylm.runtime.protocol) and the worker group that carries it: a
prepared step's commit rides on the next step's call, or reaches every rank on its own
before any other call; never twice, never to a rank that did not prepare it."""

from __future__ import annotations

import pytest
import ray

from raylm.runtime.group import Rank, WorkerGroup
from raylm.runtime.protocol import PendingCommit, StepRequest


class Recorder:
    """A rank that answers at once and keeps every call it got, in order."""

    def __init__(self):
        self.calls = []

    def train_step(self, req: StepRequest):
        self.calls.append(("train_step", req.step, req.commit, req.generation))
        return req.step

    def commit(self, step, generation):
        self.calls.append(("commit", step, generation))
        return True

    def info(self):
        self.calls.append(("info",))
        return {"rank": 0, "node_id": "n", "ip": "127.0.0.1", "pid": 0}

    def seen(self):
        return list(self.calls)


@pytest.fixture
def group(ray_cluster):
    actor = ray.remote(num_cpus=0)(Recorder)
    g = WorkerGroup(collective_timeout_s=30, huge_pages=False)
    g.ranks = [Rank(actor.remote(), (None, 0), {"rank": i, "ip": "127.0.0.1"})
               for i in range(2)]
    yield g
    g.stop()


def seen(g: WorkerGroup) -> list:
    return ray.get([r.actor.seen.remote() for r in g.ranks])


def test_a_pending_commit_is_decided_once_and_taken_once():
    pending = PendingCommit()
    assert pending.take() is None
    pending.decide(4)
    with pytest.raises(RuntimeError, match="step 4 was never sent for commit"):
        pending.decide(5)
    assert pending.take() == 4 and pending.take() is None


def test_the_commit_rides_on_the_next_step(group):
    group.wait(group.send_step([StepRequest(0, [[0]], [[1]]), StepRequest(0, [[1]], None)]))
    group.pending.decide(0)
    group.wait(group.send_step([StepRequest(1, [[2]], None), StepRequest(1, [[3]], None)]))
    assert seen(group) == [[("train_step", 0, None, 0), ("train_step", 1, 0, 0)]] * 2


def test_any_other_call_sends_the_commit_first_and_once(group):
    group.pending.decide(3)
    group.call("info")
    group.call("info")
    assert seen(group) == [[("commit", 3, 0), ("info",), ("info",)]] * 2


def test_a_regroup_commits_before_the_generation_changes(group):
    group.pending.decide(2)
    group.regroup(lambda master, generation: [r.actor.info.remote() for r in group.ranks])
    assert group.generation == 1
    assert [calls[0] for calls in seen(group)] == [("commit", 2, 0)] * 2


def test_newcomers_get_no_commit_of_a_step_they_did_not_prepare(group):
    group.pending.decide(7)
    newcomer = ray.remote(num_cpus=0)(Recorder).remote()
    group.add([newcomer], [(None, 0)], [{"node_id": "n"}])
    group.call("info")
    old, _, new = seen(group)
    assert old == [("commit", 7, 0), ("info",)] and new == [("info",)]
