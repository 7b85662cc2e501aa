"""Rank processes kept between the runs of one driver (``raylm.keep_ranks``).

A run's rank actors spend most of its start-up importing torch and transformers' model
code (README, "Start-up"): about 7 of a warm driver's 8 s. A driver that trains several
times on one Ray cluster (a sweep, a notebook, a test session) can keep them: at the end
of a run its ranks leave their process group and wait, idle, with their placement group
and the places of any ranks it lost; the next run of the same shape takes them
(``take``), starts only the ranks it has more of (in those places first), and builds
its engines. Ray itself cannot do this: it starts a fresh process for every actor and
never gives an actor a worker that ran tasks or another actor.

Kept ranks hold their bundles' CPUs (and GPUs) while they wait, so they are kept only
inside ``keep_ranks`` and released when it ends, when a run has another shape, when the
data must be tokenized first and they leave Ray Data's tasks no CPU, or when Ray went
away. A
run of fewer ranks takes as many as it needs and leaves the rest idle beside it (a
placement group frees its bundles only all together), unless that leaves Ray Data no
CPU; the next run gets them all back.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Iterator, Optional

import ray
from ray.util.placement_group import remove_placement_group

from raylm.runtime.cluster import cluster_id

log = logging.getLogger("raylm")


@dataclass
class KeptRanks:
    """Idle rank actors, where they sit and what they were started with."""
    actors: list
    slots: list  # (placement group, bundle) of each actor
    node_ids: list  # the node of each actor
    pgs: list  # the placement groups the actors hold
    cpus_per_worker: float
    use_gpu: bool
    cluster: tuple  # the Ray cluster and job they live in (their owner: this driver)
    huge_pages: bool = True  # --huge_pages they were started with (their allocator's)
    free: list = field(default_factory=list)  # (pg, bundle) places of ranks lost

    def fits(self, cpus_per_worker: float, use_gpu: bool, huge_pages: bool = True) -> bool:
        """Of this shape (a run starts the ranks it has more of, and leaves those it has
        fewer of idle)."""
        return (self.cpus_per_worker == cpus_per_worker and self.use_gpu == use_gpu
                and self.huge_pages == huge_pages and self.cluster == cluster_id())

    def release(self) -> None:
        """Stop the actors and free their bundles (on the cluster they live on)."""
        if self.cluster != cluster_id():
            return  # that job is over, and its actors with it
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed
                pass


_depth = 0  # nesting of keep_ranks()
_kept: Optional[KeptRanks] = None


@contextlib.contextmanager
def keep_ranks() -> Iterator[None]:
    """Within this block, a run that finishes leaves its rank processes up for
    the next run of the same shape (CPUs and GPU per rank) on the same Ray cluster,
    which then starts only the ranks it lacks (and leaves those it does not need idle
    until the run after). Leaving the block stops them.

        with raylm.keep_ranks():
            for lr in (1e-4, 3e-4, 1e-3):
                raylm.train(TrainConfig(..., learning_rate=lr, address="auto"))

    Needs Ray to outlive the runs: connect first (``ray.init``, or ``address`` of a
    running cluster); a run that started Ray itself stops it, and its ranks with it.
    """
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            release()


def keeping() -> bool:
    """Whether a run that ends now may leave its ranks up (inside keep_ranks)."""
    return _depth > 0 and ray.is_initialized()


def offer(kept: KeptRanks) -> None:
    """Keep ``kept`` for the next run (the caller checked ``keeping``)."""
    global _kept
    release()
    _kept = kept
    log.info("kept %d rank process(es) for the next run", len(kept.actors))


def take(cpus_per_worker: float, use_gpu: bool,
         huge_pages: bool = True) -> Optional[KeptRanks]:
    """The kept ranks, if they are of that shape (the caller then owns them); otherwise
    they are released, and None."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None and kept.fits(cpus_per_worker, use_gpu, huge_pages):
        return kept
    if kept is not None:
        kept.release()
    return None


def room_for_tasks() -> bool:
    """Whether the cluster has CPUs left, outside every reservation, for Ray Data's
    tasks (two of them)."""
    from raylm.data.tokenized import TASK_NUM_CPUS

    return ray.available_resources().get("CPU", 0.0) >= 2 * TASK_NUM_CPUS


def current() -> Optional[KeptRanks]:
    """The ranks kept now, if any (still kept)."""
    return _kept


def release() -> None:
    """Stop the kept ranks, if any."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        kept.release()
