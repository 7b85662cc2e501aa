"""Quiet failures, watched: a heartbeat that does not depend on the training thread (each
rank answers ``ping`` on a thread of its own), a step deadline from the run's own step
times, and stragglers (ranks persistently slower than their peers).

A rank that does not answer its heartbeat within ``timeout_s`` is lost (frozen, or its
node cut off). A step that does not end within ``StepDeadline.limit`` is stuck; the ranks
furthest behind in it are lost (the others wait on them in a collective). Either way the
lost ranks are ended (``end``), which on gloo releases the survivors blocked on them.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray

log = logging.getLogger("raylm")


@dataclass
class _Ping:
    ref: Any  # the ping in flight (None: answered, the next one not due yet)
    sent_at: float
    doing: tuple  # what the rank said it was doing (RankWorker.doing)


class Heartbeats:
    """Each rank pinged every ``interval_s``; one whose ping is unanswered after
    ``timeout_s`` is lost."""

    def __init__(self, interval_s: float, timeout_s: float):
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.pings: dict = {}  # id(actor) -> _Ping
        self.checked_at = 0.0

    def due(self) -> bool:
        return time.time() - self.checked_at >= self.interval_s

    def check(self, actors: list) -> list[int]:
        """Read the answers, send the pings due; the indices of the ranks silent for
        longer than the timeout."""
        now = self.checked_at = time.time()
        keys = [id(a) for a in actors]
        for key in set(self.pings) - set(keys):  # (ranks no longer in the group)
            del self.pings[key]
        flying = [p.ref for p in self.pings.values() if p.ref is not None]
        answered = set(ray.wait(flying, num_returns=len(flying), timeout=0)[0]) \
            if flying else set()
        lost = []
        for i, (key, actor) in enumerate(zip(keys, actors)):
            p = self.pings.get(key)
            if p is None:
                self.pings[key] = _Ping(actor.ping.remote(), now, (0, -1, "starting"))
                continue
            if p.ref is not None and p.ref in answered:
                try:
                    p.doing = tuple(ray.get(p.ref))
                except Exception:  # died: the call it was on fails as well
                    pass
                p.ref = None
            if p.ref is not None:
                if now - p.sent_at > self.timeout_s:
                    lost.append(i)
            elif now - p.sent_at >= self.interval_s:
                p.ref, p.sent_at = actor.ping.remote(), now
        return lost

    def doing(self, actor) -> tuple:
        """What ``actor`` last said it was doing: (step, phase index, words)."""
        p = self.pings.get(id(actor))
        return p.doing if p is not None else (0, -1, "starting")

    def silent_s(self, actor) -> float:
        p = self.pings.get(id(actor))
        return time.time() - p.sent_at if p is not None and p.ref is not None else 0.0


class StepDeadline:
    """How long a step may take: ``factor`` times the median of the recent steps, and at
    least ``floor_s`` (the first steps compile and warm up)."""

    def __init__(self, factor: float, floor_s: float, window: int = 20):
        self.factor, self.floor_s = factor, floor_s
        self.times: collections.deque = collections.deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self.times.append(seconds)

    def limit(self) -> float:
        if not self.times:
            return self.floor_s
        return max(self.floor_s, self.factor * statistics.median(self.times))


class Stragglers:
    """Ranks slower than their peers (the ranks doing the same work: the same pipeline
    stage and tensor-parallel shard) step after step. A rank is slow in a step when its
    own work (its step less its waits on the others) is over ``factor`` times its peers'
    median; slow in ``steps`` steps in a row, it is a straggler."""

    def __init__(self, factor: float, steps: int):
        self.factor, self.steps = factor, steps
        self.streak: dict = {}  # rank -> slow steps in a row

    def observe(self, own: list[float], peers: list) -> tuple:
        """``own``: each rank's own work in the step; ``peers``: each rank's key of the
        work it shares with its peers. Returns (the rank furthest behind its peers'
        median, or None with no peers; by how many seconds; the ranks that have just
        been slow for ``steps`` steps in a row)."""
        worst, behind_s, persistent = None, 0.0, []
        for r, t in enumerate(own):
            others = [own[k] for k in range(len(own)) if k != r and peers[k] == peers[r]]
            if not others:
                continue
            median = statistics.median(others)
            if worst is None or t - median > behind_s:
                worst, behind_s = r, t - median
            slow = t > self.factor * median
            self.streak[r] = self.streak.get(r, 0) + 1 if slow else 0
            if self.streak[r] == self.steps:
                persistent.append(r)
        return worst, behind_s, persistent

    def reset(self) -> None:
        """The group changed: ranks are renumbered."""
        self.streak.clear()


def behind(doings: list[tuple]) -> list[int]:
    """The indices of the ranks furthest behind in a step (the lowest step, then phase):
    the others wait on them. All of them when none is behind another."""
    least = min(d[:2] for d in doings)
    return [i for i, d in enumerate(doings) if d[:2] == least]


def describe_doing(doing: tuple) -> str:
    step, phase, words = doing
    return f"step {step}: {words}" if phase >= 0 else words


def end(infos: list[dict]) -> None:
    """End rank processes that cannot end themselves (frozen, stuck): SIGKILL, here when
    the process is on this node, else from a task on its node. A node that is cut off
    cannot be reached either way; Ray's health checks end its processes."""
    here = ray.get_runtime_context().get_node_id()
    for info in infos:
        pid, node = info.get("pid"), info.get("node_id")
        if not pid:
            continue
        if node == here:
            _sigkill(pid)
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            ray.remote(num_cpus=0, max_retries=0)(_sigkill).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(pid)


def _sigkill(pid: int) -> Optional[bool]:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
