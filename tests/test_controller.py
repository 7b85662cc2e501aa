"""The run's state machine (raylm.runtime.controller) with fake handlers: no Ray, no ranks.
Each scenario is a script of what the handlers do; the log of entered states is asserted."""

from __future__ import annotations

import pytest

from raylm.runtime.controller import TRANSITIONS, Controller, State, Transition
from raylm.runtime.policy import FailurePolicy

S = State


class RankLost(Exception):
    pass


class FakeRun:
    """Handlers that follow a script: ``script[state]`` is a list of outcomes, one per
    visit (a State to go to, or an exception to raise); recovery asks a real
    FailurePolicy, as the driver does."""

    def __init__(self, script: dict, max_failures: int = 3):
        self.script = {k: list(v) for k, v in script.items()}
        self.entered: list = []
        self.failures = 0
        self.policy = FailurePolicy(max_failures)
        self.decision = None
        handlers = {s: (lambda s=s: self.visit(s)) for s in State}
        handlers[S.RECOVERING] = self.recover
        handlers[S.FAILED] = self.fail
        handlers[S.FINISHED] = lambda: None
        self.ctl = Controller(handlers, self.enter, RankLost, self.on_failure)

    def enter(self, state, detail):
        self.entered.append((state, detail))

    def visit(self, state):
        outcome = self.script[state].pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return Transition(outcome)

    def on_failure(self, error):
        self.failures += 1
        self.decision = self.policy.decide(self.failures, str(error))
        return Transition(S.RECOVERING, self.decision.reason)

    def recover(self):
        if not self.decision.restart:
            return Transition(S.FAILED, self.decision.reason)
        return self.visit(S.RECOVERING)

    def fail(self):
        raise RuntimeError(f"gave up: {self.decision.reason}")

    def run(self):
        self.ctl.run(Transition(S.RUNNING), after=S.STARTING)
        return [s for s, _ in self.entered]


def test_a_run_without_events():
    run = FakeRun({S.RUNNING: [S.FINISHING], S.FINISHING: [S.FINISHED]})
    assert run.run() == [S.RUNNING, S.FINISHING, S.FINISHED]


def test_growth_resizes_then_runs_on():
    run = FakeRun({S.RUNNING: [S.RESIZING, S.FINISHING], S.RESIZING: [S.RUNNING],
                   S.FINISHING: [S.FINISHED]})
    assert run.run() == [S.RUNNING, S.RESIZING, S.RUNNING, S.FINISHING, S.FINISHED]


def test_a_failure_while_running_recovers_in_memory():
    run = FakeRun({S.RUNNING: [RankLost("rank 1"), S.FINISHING],
                   S.RECOVERING: [S.RUNNING], S.FINISHING: [S.FINISHED]})
    assert run.run() == [S.RUNNING, S.RECOVERING, S.RUNNING, S.FINISHING, S.FINISHED]
    assert run.entered[1] == (S.RECOVERING, "failure 1 of at most 3")
    assert str(run.ctl.error) == "rank 1"


def test_a_restart_from_a_checkpoint_goes_through_starting():
    run = FakeRun({S.RUNNING: [RankLost("node lost"), S.FINISHING],
                   S.RECOVERING: [S.STARTING], S.STARTING: [S.RUNNING],
                   S.FINISHING: [S.FINISHED]})
    assert run.run() == [S.RUNNING, S.RECOVERING, S.STARTING, S.RUNNING, S.FINISHING,
                         S.FINISHED]


def test_a_failure_during_recovery_or_restart_recovers_again():
    run = FakeRun({S.RUNNING: [RankLost("a"), S.FINISHING],
                   S.RECOVERING: [RankLost("b"), S.STARTING, S.RUNNING],
                   S.STARTING: [RankLost("c")], S.FINISHING: [S.FINISHED]})
    assert run.run() == [S.RUNNING, S.RECOVERING, S.RECOVERING, S.STARTING, S.RECOVERING,
                         S.RUNNING, S.FINISHING, S.FINISHED]
    assert run.failures == 3


def test_a_failure_while_finishing_or_resizing_recovers():
    run = FakeRun({S.RUNNING: [S.RESIZING], S.RESIZING: [RankLost("joining")],
                   S.RECOVERING: [S.FINISHING, S.FINISHING],
                   S.FINISHING: [RankLost("saving"), S.FINISHED]})
    assert run.run() == [S.RUNNING, S.RESIZING, S.RECOVERING, S.FINISHING, S.RECOVERING,
                         S.FINISHING, S.FINISHED]


def test_past_max_failures_the_run_fails():
    run = FakeRun({S.RUNNING: [RankLost("a"), RankLost("b")], S.RECOVERING: [S.RUNNING]},
                  max_failures=1)
    with pytest.raises(RuntimeError, match="gave up: 2 failure"):
        run.run()
    assert [s for s, _ in run.entered] == [S.RUNNING, S.RECOVERING, S.RUNNING,
                                           S.RECOVERING, S.FAILED]


def test_an_undeclared_transition_is_a_bug():
    run = FakeRun({S.RUNNING: [S.STARTING]})
    with pytest.raises(RuntimeError, match="no transition running -> starting"):
        run.run()


def test_other_errors_are_not_recovered():
    run = FakeRun({S.RUNNING: [ValueError("bad data")]})
    with pytest.raises(ValueError, match="bad data"):
        run.run()
    assert [s for s, _ in run.entered] == [S.RUNNING]


def test_every_state_is_reachable_and_every_run_can_end():
    reach, todo = {S.PLANNING}, [S.PLANNING]
    while todo:
        for t in TRANSITIONS[todo.pop()] - reach:
            reach.add(t)
            todo.append(t)
    assert reach == set(State)
    ends = {S.FINISHED, S.FAILED}
    for s in State:  # from each state some path reaches an end
        seen, todo = {s}, [s]
        while todo and not seen & ends:
            for t in TRANSITIONS[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        assert seen & ends, s


def test_states_compare_as_their_names():
    assert S.PLANNING == "planning" and S.RECOVERING.value == "recovering"
