"""Injected faults (raylm.runtime.faults): what a run takes, and what a rank matches."""

from __future__ import annotations

import pytest

from raylm.runtime.faults import Faults, inject, injected


def test_inject_holds_for_the_block_only_and_nests():
    assert injected() == []
    with inject({"rank": 1, "step": 2, "phase": "update"}):
        with inject({"rank": 0, "step": 3, "phase": "recovery", "generation": 2}):
            assert [f["phase"] for f in injected()] == ["update", "recovery"]
        assert injected() == [{"rank": 1, "step": 2, "phase": "update"}]
    assert injected() == []


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="fault phase 'updte'"):
        with inject({"rank": 1, "step": 2, "phase": "updte"}):
            pass
    assert injected() == []


def test_an_unknown_action_is_refused():
    with pytest.raises(ValueError, match="fault action 'hang'"):
        with inject({"rank": 1, "step": 2, "phase": "step", "action": "hang"}):
            pass
    assert injected() == []


def test_a_stall_sleeps_and_returns():
    import time

    f = Faults([{"rank": 0, "step": 1, "phase": "step", "action": "stall", "seconds": 0.2}])
    t0 = time.time()
    f.trip(0, 1, "step", 1)
    assert time.time() - t0 >= 0.2


def test_a_rank_matches_rank_step_phase_and_generation():
    f = Faults([{"rank": 1, "step": 2, "phase": "update"},
                {"rank": 0, "step": 3, "phase": "recovery", "generation": 2}])
    assert f.at(1, 2, "update", 1) and f.at(0, 3, "recovery", 2)
    assert not f.at(1, 2, "update", 2) and not f.at(0, 2, "update", 1)
    assert not f.at(1, 3, "update", 1) and not f.at(1, 2, "commit", 1)


def test_no_faults_do_nothing():
    f = Faults()
    assert not f.points and not f.at(0, 0, "step", 1)
    f.trip(0, 0, "step", 1)  # returns: the process lives
    assert f.arm_step(0, 0, 1, sync=None, rounds=1) == []
