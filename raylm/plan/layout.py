"""The Plan: how many ranks, how they divide into dp x pp x tp, and the batch geometry.

The driver makes a Plan before any actor starts, and makes a new one when the cluster
changes (a lost worker). The global batch size is fixed by the first plan of a run and
never changes after: a re-plan with fewer data-parallel ranks gives each rank more
micro-batches, so the samples of every step, and so the losses, stay the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raylm.errors import ConfigError

# Mesh dimension order: dp outermost, tp innermost (tensor-parallel peers are adjacent
# ranks, which placement keeps on one node).
MESH_DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Plan:
    dp: int
    pp: int
    tp: int
    micro_batch_size: int
    global_batch_size: int
    cpus_per_worker: float
    use_gpu: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)

    @property
    def micro_batches_per_rank(self) -> int:
        return math.ceil(self.global_batch_size / (self.dp * self.micro_batch_size))

    @property
    def torch_threads(self) -> int:
        return max(1, int(self.cpus_per_worker))

    def describe(self) -> str:
        return (f"{self.world_size} rank(s): dp={self.dp} x pp={self.pp} x tp={self.tp}; "
                f"global batch {self.global_batch_size} = {self.micro_batches_per_rank} "
                f"micro-batch(es) of {self.micro_batch_size} on each of {self.dp} "
                f"data-parallel rank(s)")

    def resized(self, num_workers: int) -> "Plan":
        """The plan for ``num_workers`` ranks, same global batch (elastic re-plan)."""
        group = self.pp * self.tp
        dp = num_workers // group
        if dp < 1:
            raise ConfigError(f"{num_workers} worker(s) cannot hold one pp={self.pp} x "
                              f"tp={self.tp} replica")
        return Plan(dp=dp, pp=self.pp, tp=self.tp, micro_batch_size=self.micro_batch_size,
                    global_batch_size=self.global_batch_size,
                    cpus_per_worker=self.cpus_per_worker, use_gpu=self.use_gpu)


def make_plan(cfg, capacity: int) -> Plan:
    """Choose the layout for a TrainConfig on a cluster that can hold ``capacity`` ranks."""
    for name in ("dp", "tp", "pp", "num_workers"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0")
    if cfg.tp > 1:
        raise ConfigError("--tp > 1: tensor parallelism is not implemented yet in raylm "
                          "(data parallelism only for now)")
    if cfg.pp > 1:
        raise ConfigError("--pp > 1: pipeline parallelism is not implemented yet in raylm "
                          "(data parallelism only for now)")
    if cfg.per_device_train_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("--per_device_train_batch_size and --gradient_accumulation_steps "
                          "must be >= 1")
    tp, pp = 1, 1
    if cfg.num_workers:
        num_workers = cfg.num_workers
        if num_workers > capacity:
            raise ConfigError(
                f"--num_workers {num_workers}: the cluster can place only {capacity} "
                f"worker(s) of {cfg.cpus_per_worker:g} CPU{' and 1 GPU' if cfg.use_gpu else ''}"
                " each")
    elif cfg.dp:
        num_workers = cfg.dp * tp * pp
        if num_workers > capacity:
            raise ConfigError(f"--dp {cfg.dp}: the cluster can place only {capacity} worker(s)")
    else:
        num_workers = capacity
    if num_workers < 1:
        raise ConfigError("the cluster has no room for a single worker "
                          f"({cfg.cpus_per_worker:g} CPU each); lower --cpus_per_worker")
    dp = cfg.dp or num_workers // (tp * pp)
    if dp * tp * pp != num_workers:
        raise ConfigError(f"dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} does not equal "
                          f"--num_workers {num_workers}")
    return Plan(dp=dp, pp=pp, tp=tp, micro_batch_size=cfg.per_device_train_batch_size,
                global_batch_size=cfg.per_device_train_batch_size
                * cfg.gradient_accumulation_steps * dp,
                cpus_per_worker=cfg.cpus_per_worker, use_gpu=cfg.use_gpu)
