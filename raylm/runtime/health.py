"""Quiet failures, watched: a heartbeat that does not depend on the training thread (each
rank answers ``ping`` on a thread of its own), a step deadline from the run's own step
times, and stragglers (ranks persistently slower than their peers).

A rank that does not answer its heartbeat within ``timeout_s`` is lost (frozen, or its
node cut off). A step that does not end within ``StepDeadline.limit`` is stuck; the ranks
furthest behind in it are lost (the others wait on them in a collective). Either way the
lost ranks are ended (``end``) and the survivors released (``release_sockets``: each
closes its own connections to them), which works when their node is cut off too.
"""

from __future__ import annotations

import collections
import ipaddress
import os
import signal
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import ray


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
        # id(actor) -> its TCP sockets (local_endpoints), as last reported (kept when a
        # watch starts afresh: the rank sends them again only when they change)
        self.known: dict = {}
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
        for key in set(self.known) - set(keys):
            del self.known[key]
        self.read()
        lost = []
        for i, (key, actor) in enumerate(zip(keys, actors)):
            p = self.pings.get(key)
            if p is None:
                self.pings[key] = _Ping(actor.ping.remote(key in self.known), now,
                                       (0, -1, "starting"))
                continue
            if p.ref is not None:
                if now - p.sent_at > self.timeout_s:
                    lost.append(i)
            elif now - p.sent_at >= self.interval_s:
                p.ref, p.sent_at = actor.ping.remote(key in self.known), now
        return lost

    def read(self) -> None:
        """Take in the answers that have come (what each rank does, its endpoints)."""
        flying = {p.ref: key for key, p in self.pings.items() if p.ref is not None}
        if not flying:
            return
        for ref in ray.wait(list(flying), num_returns=len(flying), timeout=0)[0]:
            key = flying[ref]
            p = self.pings[key]
            try:
                doing, endpoints = ray.get(ref)
                p.doing = tuple(doing)
                if endpoints is not None:  # (None: unchanged)
                    self.known[key] = endpoints
            except Exception:  # died: the call it was on fails as well
                pass
            p.ref = None

    def doing(self, actor) -> tuple:
        """What ``actor`` last said it was doing: (step, phase index, words)."""
        p = self.pings.get(id(actor))
        return p.doing if p is not None else (0, -1, "starting")

    def endpoints(self, actor) -> frozenset:
        """``actor``'s TCP sockets at its last answer (``local_endpoints``)."""
        return self.known.get(id(actor), frozenset())


class StepDeadline:
    """How long a step may take: ``factor`` times the median of the recent steps, and at
    least ``floor_s`` (the first steps compile and warm up)."""

    def __init__(self, factor: float, floor_s: float, window: int = 20):
        self.factor, self.floor_s = factor, floor_s
        self.times: collections.deque = collections.deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self.times.append(seconds)

    def median(self) -> float:
        """The recent steps' median time (0 before the first)."""
        return statistics.median(self.times) if self.times else 0.0

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
        self.streak = np.zeros(0, dtype=np.int64)  # per rank: slow steps in a row

    def observe(self, own, peers) -> tuple:
        """``own``: each rank's own work in the step; ``peers``: each rank's key of the
        work it shares with its peers. Returns (the rank furthest behind its peers'
        median, or None with no peers; by how many seconds; (rank, its peers' median) of
        the ranks that have just been slow for ``steps`` steps in a row). In array
        operations: the driver runs it every step, for every rank."""
        own = np.asarray(own, dtype=np.float64)
        median = peers_median(own, peers)
        has = ~np.isnan(median)
        if len(self.streak) != len(own):
            self.streak = np.zeros(len(own), dtype=np.int64)
        if not has.any():
            return None, 0.0, []
        gap = np.where(has, own - median, -np.inf)
        worst = int(np.argmax(gap))  # (the first of the largest)
        slow = has & (own > self.factor * median)
        self.streak = np.where(slow, self.streak + 1, 0)
        persistent = [(int(r), float(median[r]))
                      for r in np.flatnonzero(self.streak == self.steps)]
        return worst, float(gap[worst]), persistent

    def reset(self) -> None:
        """The group changed: ranks are renumbered."""
        self.streak = np.zeros(0, dtype=np.int64)


def peers_median(own: np.ndarray, peers) -> np.ndarray:
    """Each rank's peers' median of ``own`` (itself left out; NaN for a rank without
    peers): a sort within each group of peers, no loop over ranks."""
    n = len(own)
    if isinstance(peers, np.ndarray) and peers.dtype.kind == "i":
        gid = peers
    else:
        index: dict = {}
        gid = np.array([index.setdefault(p, len(index)) for p in peers], dtype=np.int64)
    order = np.lexsort((own, gid))
    vals, g = own[order], gid[order]
    starts = np.searchsorted(g, g, side="left")  # each one's group's first place
    counts = np.searchsorted(g, g, side="right") - starts
    pos = np.arange(n) - starts  # its place in its group, by time
    m = counts - 1  # its peers

    def peer(j):  # the j-th fastest of its peers (itself skipped)
        j = np.clip(j, 0, np.maximum(m - 1, 0))
        return vals[np.minimum(starts + j + (j >= pos), n - 1)]

    med = np.where(m > 0, (peer((m - 1) // 2) + peer(m // 2)) / 2, np.nan)
    out = np.empty(n)
    out[order] = med
    return out


def behind(doings: list[tuple]) -> list[int]:
    """The indices of the ranks furthest behind in a step (the lowest step, then phase):
    the others wait on them. All of them when none is behind another."""
    least = min(d[:2] for d in doings)
    return [i for i, d in enumerate(doings) if d[:2] == least]


def describe_doing(doing: tuple) -> str:
    step, phase, words = doing
    return f"step {step}: {words}" if phase >= 0 else words


def end(infos: list[dict]) -> dict:
    """End rank processes that cannot end themselves (frozen, stuck): SIGKILL, here when
    the process is on this node, else from a task on its node. Returns {node id: that
    task}: a node cut off runs it only once it is reachable again."""
    here = ray.get_runtime_context().get_node_id()
    tasks = {}
    for info in infos:
        pid, node = info.get("pid"), info.get("node_id")
        if not pid:
            continue
        if node == here:
            _sigkill(pid)
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            tasks[node] = _remote_sigkill().options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(pid)
    return tasks


_sigkill_task = None


def _remote_sigkill():
    global _sigkill_task
    if _sigkill_task is None:
        _sigkill_task = ray.remote(num_cpus=0, max_retries=0)(_sigkill)
    return _sigkill_task


def _sigkill(pid: int) -> Optional[bool]:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


# -- releasing survivors -------------------------------------------------------------------
# A survivor blocked in a gloo collective on a peer whose process is gone is released
# when the peer's sockets close. A peer that is frozen, or on a node cut off, closes
# nothing, and neither gloo's abort nor destroying the group frees a rank blocked in a
# collective: so the survivor shuts down its own sockets to the peer, found by the
# peer's sockets as it reported them while it was well (both ends of each connection),
# from a thread of its own. The collective then raises at once and the process keeps
# its state. Only those sockets: shutting down gloo's listener too makes gloo end the
# process.

def _tcp_sockets():
    """This process's TCP sockets, each as a socket object that shares its fd (detach
    it after use, so that the fd stays its owner's)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=int(fd))
        except OSError:  # closed meanwhile
            continue
        if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
            yield s
        else:
            s.detach()


def _endpoint(address) -> tuple:
    """(ip, port), an IPv4-mapped IPv6 address as IPv4."""
    ip = ipaddress.ip_address(address[0].split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), address[1]


def local_endpoints() -> frozenset:
    """This process's TCP sockets, as a peer finds its connections to them: each
    listener as ((ip, port), None), each connection as ((local ip, port), (peer ip,
    port)). A connection needs both ends: a client's local port is unique only with its
    peer's, and another process on the host may use the same number for another peer."""
    out = set()
    for s in _tcp_sockets():
        try:
            local = _endpoint(s.getsockname())
            listening = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            out.add((local, None if listening else _endpoint(s.getpeername())))
        except OSError:  # neither listening nor connected, or closed meanwhile
            pass
        finally:
            s.detach()
    return frozenset(out)


def release_sockets(peer_endpoints) -> int:
    """Shut down this process's connections to a lost peer (its ``local_endpoints``):
    those to its listeners, and those whose two ends mirror one of its connections.
    What this process is blocked on in them raises. Returns how many."""
    listeners, connections = set(), set()
    for local, peer in peer_endpoints:
        if peer is None:
            listeners.add(tuple(local))
        else:
            connections.add((tuple(peer), tuple(local)))  # (as this side sees it)
    shut = 0
    for s in _tcp_sockets():
        try:
            ends = (_endpoint(s.getsockname()), _endpoint(s.getpeername()))
            if ends[1] in listeners or ends in connections:
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:  # not connected (a listener), or closed meanwhile
            pass
        finally:
            s.detach()
    return shut


def abort_groups() -> bool:
    """NCCL: a survivor blocked on a lost peer raises nothing, and closing sockets does
    not reach the GPU. Abort every communicator of this process at once (torch's abort
    of the world group aborts them all inside one NCCL group call: aborting them one by
    one can deadlock, pytorch#119797); the collective under way then fails, and the rank
    joins a fresh group. False when there was none."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        dist.distributed_c10d._abort_process_group()
    except ValueError:  # destroyed meanwhile (the rank left its group on its own)
        return False
    return True
