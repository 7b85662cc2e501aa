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
    sequence_parallel: bool = False  # tp > 1: norms and dropouts on sequence shards

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
        sp = " (sequence parallel)" if self.sequence_parallel else ""
        text = (f"{self.world_size} rank(s): dp={self.dp} x pp={self.pp} x tp={self.tp}{sp}; "
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


def make_plan(cfg, capacity: int, spec=None, seq_len=None, search=None) -> Plan:
    """Choose the layout for a TrainConfig on a cluster that can hold ``capacity`` ranks.

    With --dp, --tp and --pp all 0 the planner (raylm.plan.planner) chooses dp x tp x pp,
    the micro-batches and the schedule for the workers, holding the global batch at
    per_device_train_batch_size x gradient_accumulation_steps x workers. ``spec`` and
    ``seq_len`` (the resolved model and block size) are resolved from ``cfg`` when not
    given; ``search``: a planner search already made for these workers."""
    for name in ("dp", "tp", "pp", "num_workers"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0")
    if cfg.per_device_train_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("--per_device_train_batch_size and --gradient_accumulation_steps "
                          "must be >= 1")
    tp, pp = cfg.tp or 1, cfg.pp or 1
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
    accum, schedule = cfg.gradient_accumulation_steps, cfg.pipeline_schedule
    if not (cfg.dp or cfg.tp or cfg.pp):  # the planner's layout
        from raylm.plan.planner import choose_for_config

        chosen = choose_for_config(cfg, num_workers, spec, seq_len, search)
        tp, pp, accum = chosen.tp, chosen.pp, chosen.microbatches
        schedule = chosen.schedule if pp > 1 else schedule
    if num_workers < tp * pp:
        raise ConfigError(f"--num_workers {num_workers} cannot hold one pp={pp} x tp={tp} "
                          "replica")
    dp = cfg.dp or num_workers // (tp * pp)
    if dp * tp * pp != num_workers:
        raise ConfigError(f"dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} does not equal "
                          f"--num_workers {num_workers}")
    return Plan(dp=dp, pp=pp, tp=tp, micro_batch_size=cfg.per_device_train_batch_size,
                global_batch_size=cfg.per_device_train_batch_size * accum * dp,
                cpus_per_worker=cfg.cpus_per_worker, use_gpu=cfg.use_gpu,
                schedule=schedule,
                sequence_parallel=bool(cfg.sequence_parallel and tp > 1))


def plan_pipeline(cfg, spec, plan: Plan, seq_len: int):
    """For pp > 1: cut the model into stages and check the schedule (driver side, no
    weights: the model is built on the meta device). Returns (plan, Partition)."""
    from raylm.models.families import family_of
    from raylm.parallel.pipeline.stages import meta_model, model_units
    from raylm.plan.partition import check_schedule, partition, virtual_stages

    schedule = plan.schedule  # the user's --pipeline_schedule, or the planner's choice
    virtual = virtual_stages(schedule, cfg.pp_virtual_stages)
    check_schedule(schedule, plan.pp, virtual, plan.micro_batches_per_rank)
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
    part = partition(embed, blocks, head, plan.pp, schedule, virtual, split)
    return dataclasses.replace(plan, virtual=virtual,
                               stage_bounds=tuple(tuple(b) for b in part.bounds),
                               seq_len=seq_len), part


def check_tensor_layout(spec, plan: Plan, seq_len: int) -> None:
    """For tp > 1: the one-line errors a tensor-parallel layout can hit, before any actor
    starts (driver side, no weights)."""
    from raylm.models.families import family_of
    from raylm.parallel.pipeline.stages import is_t5
    from raylm.parallel.tensor import check_tensor_parallel

    if plan.tp <= 1:
        return
    check_tensor_parallel(spec.config, plan.tp, plan.sequence_parallel)
    if plan.sequence_parallel and seq_len % plan.tp:
        raise ConfigError(f"--sequence_parallel with --tp {plan.tp}: the block size "
                          f"{seq_len} must be a multiple of tp (each rank holds an equal "
                          "slice of the sequence)")
    if plan.pp > 1:
        if plan.sequence_parallel:
            raise ConfigError("--sequence_parallel with --pp > 1 is not supported yet: "
                              "stages exchange whole sequences; drop one of the two")
        if family_of(spec.config) is None and not is_t5(spec.config):
            raise ConfigError(f"--tp {plan.tp} with --pp {plan.pp}: raylm cuts "
                              f"'{spec.config.model_type}' into stages by tracing it with "
                              "torch.export, which does not take tensor-parallel layers; "
                              "use one of the two, or a model type raylm has stages for")
