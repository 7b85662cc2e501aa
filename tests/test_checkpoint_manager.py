"""Checkpoints are committed atomically: a half-written one is never found."""

from __future__ import annotations

import os

from raylm.checkpoint.manager import CheckpointManager


def test_only_committed_checkpoints_are_found(tmp_path):
    m = CheckpointManager(str(tmp_path))
    assert m.latest() is None
    tmp = m.begin(10)
    (open(os.path.join(tmp, "part"), "w")).write("x")
    assert m.latest() is None  # a save in progress (or crashed) is invisible
    path = m.commit(tmp, 10, {"step": 10})
    assert m.latest() == path and not os.path.exists(tmp)
    crashed = m.begin(20)  # a crash after writing, before the commit
    assert m.latest() == path
    m.clear_partial()
    assert not os.path.exists(crashed)


def test_rotation_keeps_the_newest(tmp_path):
    m = CheckpointManager(str(tmp_path))
    for step in (5, 10, 15, 20):
        m.commit(m.begin(step), step, {"step": step})
    m.rotate(2)
    assert [s for s, _ in m.list()] == [15, 20]
    assert sorted(os.listdir(m.root)) == ["step-00000015", "step-00000020"]
    # Saving the same step again (after a recovery) replaces it.
    m.commit(m.begin(20), 20, {"step": 20, "again": True})
    assert [s for s, _ in m.list()] == [15, 20]
