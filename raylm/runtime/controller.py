"""The run's states and the one loop that moves between them.

Every way a run can go (``TRANSITIONS``)::

    planning   -> starting                 (the first start: a failure there ends the run)
    starting   -> running | finishing | recovering
    running    -> resizing | finishing | recovering
    resizing   -> running | finishing | recovering
    finishing  -> finished | recovering
    recovering -> running | finishing | starting (from a checkpoint) | recovering | failed

Each state's handler does that state's work and says where the run goes next; a rank
failure in a state that may go to ``recovering`` goes there, and its handler carries on
in memory, restarts the group from a checkpoint or gives up. Nothing here knows Ray: the
driver supplies the handlers (raylm.runtime.driver), tests supply fakes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional


class State(str, enum.Enum):
    PLANNING = "planning"  # checking the inputs, starting Ray, planning, the data
    STARTING = "starting"  # placing and starting the ranks, building, restoring
    RUNNING = "running"  # training steps
    RESIZING = "resizing"  # newcomers joining the group at a step boundary
    RECOVERING = "recovering"  # after a rank failure
    FINISHING = "finishing"  # the final evaluation and the saved model
    FINISHED = "finished"
    FAILED = "failed"  # given up (--max_failures)


S = State
TRANSITIONS = {
    S.PLANNING: {S.STARTING},
    S.STARTING: {S.RUNNING, S.FINISHING, S.RECOVERING},
    S.RUNNING: {S.RESIZING, S.FINISHING, S.RECOVERING},
    S.RESIZING: {S.RUNNING, S.FINISHING, S.RECOVERING},
    S.RECOVERING: {S.RUNNING, S.FINISHING, S.STARTING, S.FAILED, S.RECOVERING},
    S.FINISHING: {S.FINISHED, S.RECOVERING},
    S.FINISHED: set(),
    S.FAILED: set(),
}


@dataclass(frozen=True)
class Transition:
    to: State
    detail: str = ""  # what the log line says of the new state


class Controller:
    """Runs the states' handlers in turn. ``handlers[state]()`` returns the next
    ``Transition`` (None from a final state ends the loop); ``enter(state, detail)`` logs
    each change; an exception of ``failure`` type in a state that may go to RECOVERING
    goes to ``on_failure(error)``, which returns that transition (with its reason)."""

    def __init__(self, handlers: dict, enter: Callable[[State, str], None],
                 failure: type, on_failure: Callable[[BaseException], Transition]):
        self.handlers, self.enter = handlers, enter
        self.failure, self.on_failure = failure, on_failure
        self.state: Optional[State] = None
        self.error: Optional[BaseException] = None  # the failure being recovered from

    def run(self, start: Transition, after: State = S.PLANNING) -> None:
        """From ``after`` (the state the run is in) through ``start`` to a final state."""
        self.state, step = after, start
        while step is not None:
            if step.to not in TRANSITIONS[self.state]:
                raise RuntimeError(f"no transition {self.state.value} -> {step.to.value}")
            self.state = step.to
            self.enter(step.to, step.detail)
            try:
                step = self.handlers[step.to]()
            except self.failure as error:
                if S.RECOVERING not in TRANSITIONS[self.state]:
                    raise
                self.error = error
                step = self.on_failure(error)
