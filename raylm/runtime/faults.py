"""Injected rank faults, for tests and benchmarks: at a given step, phase and group
generation a rank dies (as a killed process does), freezes (SIGSTOP: alive, its sockets
open, answering nothing), stalls (sleeps ``seconds``, answering heartbeats), or its
gradients overflow.

A run takes the faults ``inject`` set in its process; a rank holds them as ``Faults``,
which does nothing when empty. Phases: "step" (before its forward), "sync" (during its
gradient sync), "overflow" (its gradient becomes inf before the sync, as an fp16
overflow; the rank lives), "update" (after the sync), "agreed" (--step_protocol ranks:
after the step's all-gather, before rank 0 answers and any rank commits), "commit",
"checkpoint", "recovery" (rejoining after a failure). ``step`` counts the committed steps before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

log = logging.getLogger("raylm")

PHASES = ("step", "sync", "overflow", "update", "agreed", "commit", "checkpoint",
          "recovery")
ACTIONS = ("die", "freeze", "stall")
_injected: list = []  # the faults the next runs in this process take (inject)


@contextlib.contextmanager
def inject(*faults: dict):
    """Inside, runs started in this process inject ``faults``: dicts of rank, step,
    phase, generation (default 1), action (default "die") and, to stall, seconds."""
    for f in faults:
        if f["phase"] not in PHASES:
            raise ValueError(f"fault phase {f['phase']!r}: one of {', '.join(PHASES)}")
        if f.get("action", "die") not in ACTIONS:
            raise ValueError(f"fault action {f['action']!r}: one of {', '.join(ACTIONS)}")
    _injected.extend(dict(f) for f in faults)
    try:
        yield
    finally:
        del _injected[len(_injected) - len(faults):]


def injected() -> list:
    """The faults a run started now injects (a copy, sent to its ranks)."""
    return [dict(f) for f in _injected]


class Faults:
    """A rank's injected faults; with none, every call returns at once."""

    def __init__(self, faults=()):
        self.points = {(f["rank"], f["step"], f["phase"], f.get("generation", 1)):
                       (f.get("action", "die"), f.get("seconds", 0.0)) for f in faults or ()}

    def at(self, rank: int, step: int, phase: str, generation: int) -> bool:
        return bool(self.points) and (rank, step, phase, generation) in self.points

    def trip(self, rank: int, step: int, phase: str, generation: int) -> None:
        """The fault set for this point, if any, happens here: the process dies,
        freezes or stalls."""
        if not self.at(rank, step, phase, generation):
            return
        action, seconds = self.points[(rank, step, phase, generation)]
        log.warning("rank %d: injected fault at step %d (%s): %s", rank, step + 1, phase,
                    action)
        if action == "die":
            os._exit(1)
        elif action == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(seconds)

    def arm_step(self, rank: int, step: int, generation: int, sync, rounds: int):
        """Before a step's forward: the hooks of its "sync" fault (die once the last
        micro-batch's gradient of the first parameter the sync holds is ready, the last to
        be in backward) and its "overflow" fault (that gradient becomes inf before the
        sync adds it up, so the sum is inf on every dp replica). Returns the hooks to
        remove after backward."""
        if not self.points:
            return []
        import torch

        param, hooks = sync.params[0], []
        if self.at(rank, step, "sync", generation):
            calls = []

            def die(_):
                calls.append(1)
                if len(calls) == rounds:
                    self.trip(rank, step, "sync", generation)

            param.register_post_accumulate_grad_hook(die)
        if self.at(rank, step, "overflow", generation):
            log.warning("rank %d: injected gradient overflow at step %d", rank, step + 1)
            hooks.append(param.register_hook(lambda g: torch.full_like(g, float("inf"))))
        return hooks
