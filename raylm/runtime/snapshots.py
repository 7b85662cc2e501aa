"""Snapshots of the training state in memory on other nodes (``--snapshot_steps k``).

State with no live copy (dp = 1, ZeRO's partitions of the optimizer state, gradients and
parameters) dies with its rank. Every k committed steps each rank snapshots its state in
checkpoint form (``SnapshotSender``: in a thread of its own, the rank training on; only
its next optimizer step waits, until the state is copied) into the object store, and
hands it to two keepers: the one on its own node (which outlives the rank's process) and
the one on the next node (which outlives the rank's node). Each keeper copies the chunks
into objects it owns and keeps the three newest snapshot steps. As in Gemini (Wang et
al., SOSP '23), a failure then costs at most k steps instead of --save_steps, and
nothing is read from disk: the survivors of any new layout read their shards from the
keepers (raylm.checkpoint.memory).

Ray's object store has no replication of its own (an object dies with its owner), and
DCP's storage is files: the keepers are what is written here.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylm.checkpoint.memory import ExportPlanner, MemoryState, merge
from raylm.checkpoint.state import export_rank_state

log = logging.getLogger("raylm")

# Snapshot steps a keeper holds. A rank sends snapshot s + k only once the keepers hold
# its snapshot s - k (RankWorker._snapshot), and it commits s + k only after every rank
# sent s: so when any snapshot s + k arrives, s - k is whole on every rank, and the
# three newest steps always include a whole one.
KEEP = 3


class SnapshotKeeper:
    """One per node: holds ranks' snapshots in objects it owns."""

    def __init__(self):
        self.node_id = ray.get_runtime_context().get_node_id()
        self.held: dict = {}  # (step, generation) -> {rank: (world_size, export)}

    def hold(self, step: int, generation: int, rank: int, world_size: int, metadata) -> bool:
        """Copy rank ``rank``'s snapshot of ``step`` (DCP metadata whose storage data are
        (the rank's ObjectRef of a bucket, key)) into objects of this keeper's."""
        theirs = list({ref for ref, _ in metadata.storage_data.values()})
        ours = dict(zip(theirs, (ray.put(bucket) for bucket in ray.get(theirs))))
        metadata.storage_data = {index: (ours[ref], key)
                                 for index, (ref, key) in metadata.storage_data.items()}
        self.held.setdefault((step, generation), {})[rank] = (
            world_size, {"metadata": metadata, "node_id": self.node_id, "step": step})
        for key in sorted(self.held)[:-KEEP]:
            del self.held[key]
        return True

    def holdings(self) -> dict:
        return self.held


class SnapshotSender:
    """A rank's side: each snapshot is written to the object store and handed to the
    keepers in a thread of its own while the rank trains on. The next step's forward and
    backward read the state and change none of it; only its optimizer step must wait
    until the state is copied (``wait_copied``), which the thread does first."""

    def __init__(self):
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="raylm-snapshot")
        self.planner = ExportPlanner()  # the thread's own: the rank's exports use another
        self.job = None
        self.copied = threading.Event()
        self.copied.set()

    def send(self, state: dict, keepers: list, step: int, generation: int, rank: int,
             world_size: int) -> None:
        """Start snapshotting ``state`` (Engine.checkpoint_state, views of the live
        tensors) of committed ``step``. One snapshot in flight per rank: the keepers
        hold the previous one before this one starts (so the older of a keeper's newest
        steps is whole on every rank: KEEP). A keeper slower than k steps makes the rank
        wait here."""
        self.wait()
        copied = self.copied = threading.Event()
        self.job = self.executor.submit(self._send, state, copied, keepers,
                                        (step, generation, rank, world_size))

    def _send(self, state, copied, keepers, snapshot) -> None:
        try:
            metadata = export_rank_state(state, self.planner, on_copied=copied.set)
        finally:
            copied.set()
        holding = [keeper.hold.remote(*snapshot, metadata) for keeper in keepers]
        # (A keeper on a lost node never answers: the driver asks the live ones.)
        ray.wait(holding, num_returns=len(holding))

    def wait_copied(self) -> None:
        self.copied.wait()

    def wait(self) -> None:
        if self.job is not None:
            try:
                self.job.result()
            except Exception as e:  # a snapshot less; the driver takes the newest whole one
                log.warning("a snapshot failed: %s", e)
            self.job = None


class Snapshots:
    """The driver's side: a keeper on every node, which keepers each rank sends to, and
    the newest complete snapshot the live keepers hold."""

    def __init__(self, every: int):
        self.every = every
        self.keepers: dict = {}  # node id -> actor

    def ensure_keepers(self) -> None:
        """A keeper on every live node that has none (nodes join)."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for node in list(self.keepers):
            if node not in alive:
                del self.keepers[node]
        for node in sorted(alive - set(self.keepers)):
            self.keepers[node] = ray.remote(SnapshotKeeper).options(
                num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()

    def keepers_for(self, node_id: str) -> list:
        """The keepers a rank on ``node_id`` sends to: its own node's and the next
        node's (in node id order), so that one node's loss leaves a copy."""
        self.ensure_keepers()
        nodes = sorted(self.keepers)
        if node_id not in self.keepers or len(nodes) < 2:
            return [self.keepers[n] for n in nodes[:2]]
        nxt = nodes[(nodes.index(node_id) + 1) % len(nodes)]
        return [self.keepers[node_id], self.keepers[nxt]]

    def latest(self, at_most: int) -> Optional[MemoryState]:
        """The newest snapshot at step <= ``at_most`` that the live keepers hold whole
        (every rank of the group that took it), as one MemoryState; None if none."""
        held: dict = {}
        for node, keeper in list(self.keepers.items()):
            try:
                for key, ranks in ray.get(keeper.holdings.remote(), timeout=30).items():
                    for rank, (world, export) in ranks.items():
                        held.setdefault(key, (world, {}))[1].setdefault(rank, []).append(
                            export)
            except Exception as e:  # a keeper on a lost node
                log.info("snapshot keeper on node %s unavailable: %s", node[:8], e)
                del self.keepers[node]
        for key in sorted(held, reverse=True):
            world, ranks = held[key]
            if key[0] <= at_most and len(ranks) == world:
                return merge([e for exports in ranks.values() for e in exports])
        return None

    def close(self) -> None:
        for keeper in self.keepers.values():
            try:
                ray.kill(keeper, no_restart=True)
            except Exception:
                pass
        self.keepers = {}
