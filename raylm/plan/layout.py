"""The Plan: how many ranks, how they divide into dp x pp x tp, and the batch geometry.

The driver makes a Plan before any actor starts, and makes a new one when the cluster
changes (a lost worker). The global batch size is fixed by the first plan of a run and
never changes after: a re-plan with fewer data-parallel ranks gives each rank more
micro-batches, so the samples of every step, and so the losses, stay the same.
"""

from __future__ import annotations

import dataclasses
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
    # Pipeline (pp > 1): the schedule, stages per rank, and each stage's block range.
    schedule: str = "1f1b"
    virtual: int = 1
    stage_bounds: tuple = ()
    seq_len: int = 0  # tokens per sample (a generic, exported stage is traced at it)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)

    @property
    def micro_batches_per_rank(self) -> int:
        return math.ceil(self.global_batch_size / (self.dp * self.micro_batch_size))

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica of a global rank (mesh order dp, pp, tp)."""
        return rank // (self.pp * self.tp)

    @property
    def torch_threads(self) -> int:
        return max(1, int(self.cpus_per_worker))

    def describe(self) -> str:
        text = (f"{self.world_size} rank(s): dp={self.dp} x pp={self.pp} x tp={self.tp}; "
                f"global batch {self.global_batch_size} = {self.micro_batches_per_rank} "
                f"micro-batch(es) of {self.micro_batch_size} on each of {self.dp} "
                f"data-parallel rank(s)")
        if self.pp > 1:
            stages = " | ".join(f"{a}-{b - 1}" for a, b in self.stage_bounds)
            text += (f"; pipeline {self.schedule}, {len(self.stage_bounds)} stages "
                     f"(blocks {stages})")
        return text

    def resized(self, num_workers: int) -> "Plan":
        """The plan for ``num_workers`` ranks, same global batch (elastic re-plan)."""
        group = self.pp * self.tp
        dp = num_workers // group
        if dp < 1:
            raise ConfigError(f"{num_workers} worker(s) cannot hold one pp={self.pp} x "
                              f"tp={self.tp} replica")
        return dataclasses.replace(self, dp=dp)


def make_plan(cfg, capacity: int) -> Plan:
    """Choose the layout for a TrainConfig on a cluster that can hold ``capacity`` ranks."""
    for name in ("dp", "tp", "pp", "num_workers"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0")
    if cfg.tp > 1:
        raise ConfigError("--tp > 1: tensor parallelism is not implemented yet in raylm "
                          "(data parallelism only for now)")
    if cfg.per_device_train_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("--per_device_train_batch_size and --gradient_accumulation_steps "
                          "must be >= 1")
    tp, pp = 1, cfg.pp or 1
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
            raise ConfigError(f"dp={cfg.dp} x pp={pp} x tp={tp} needs {num_workers} workers; "
                              f"the cluster can place only {capacity}")
    else:
        num_workers = capacity - capacity % (tp * pp)
    if num_workers < 1:
        need = "a single worker" if tp * pp == 1 else f"the {tp * pp} workers of pp={pp}"
        raise ConfigError(f"the cluster has no room for {need} ({cfg.cpus_per_worker:g} CPU "
                          "each); lower --cpus_per_worker")
    if num_workers < tp * pp:
        raise ConfigError(f"--num_workers {num_workers} cannot hold one pp={pp} x tp={tp} "
                          "replica")
    dp = cfg.dp or num_workers // (tp * pp)
    if dp * tp * pp != num_workers:
        raise ConfigError(f"dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} does not equal "
                          f"--num_workers {num_workers}")
    return Plan(dp=dp, pp=pp, tp=tp, micro_batch_size=cfg.per_device_train_batch_size,
                global_batch_size=cfg.per_device_train_batch_size
                * cfg.gradient_accumulation_steps * dp,
                cpus_per_worker=cfg.cpus_per_worker, use_gpu=cfg.use_gpu,
                schedule=cfg.pipeline_schedule)


def plan_pipeline(cfg, spec, plan: Plan, seq_len: int):
    """For pp > 1: cut the model into stages and check the schedule (driver side, no
    weights: the model is built on the meta device). Returns (plan, Partition)."""
    from raylm.models.families import family_of
    from raylm.parallel.pipeline.stages import meta_model, model_units
    from raylm.plan.partition import check_schedule, partition, virtual_stages

    virtual = virtual_stages(cfg.pipeline_schedule, cfg.pp_virtual_stages)
    check_schedule(cfg.pipeline_schedule, plan.pp, virtual, plan.micro_batches_per_rank)
    split = None
    if cfg.pp_split:
        try:
            split = [int(x) for x in str(cfg.pp_split).split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--pp_split {cfg.pp_split}: expected comma-separated block "
                              "indices, e.g. 3,6,9") from None
    model = meta_model(spec)
    if cfg.line_by_line and family_of(spec.config) is None:
        raise ConfigError(f"--line_by_line with --pp {plan.pp}: padded samples need an "
                          f"attention mask, which raylm's pipeline stages for "
                          f"'{spec.config.model_type}' do not take (the GPT-2, GPT-Neo, GPT-J, "
                          "Llama-family, BERT and RoBERTa stages do)")
    embed, blocks, head = model_units(model, seq_len)
    part = partition(embed, blocks, head, plan.pp, cfg.pipeline_schedule, virtual, split)
    return dataclasses.replace(plan, schedule=cfg.pipeline_schedule, virtual=virtual,
                               stage_bounds=tuple(tuple(b) for b in part.bounds),
                               seq_len=seq_len), part
