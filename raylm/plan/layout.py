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
from typing import Optional

from raylm.errors import ConfigError
from raylm.models.families import family_of
from raylm.models.tensor_plans import LORA_SP, check_tensor_parallel, layers_only
from raylm.models.units import has_own_stages, meta_model, model_units
from raylm.plan.activations import requested_recompute
from raylm.plan.constraints import (compile_problem, recompute_problem,
                                    reduce_dtype_problem, sequence_parallel_problem,
                                    tensor_pipeline_problem)
from raylm.plan.dims import ParallelDims, check_layout_flags, dims_for_workers
from raylm.plan.partition import (check_schedule, parse_pp_split, partition,
                                  virtual_stages)
from raylm.plan.planner import choose_for_config, evaluate_layout
from raylm.plan.zero import (STAGE_PARTITIONS, requested_reshard, requested_zero_stage,
                             unsupported)

@dataclass(frozen=True)
class Plan:
    dims: ParallelDims  # ranks along each axis (dp, pp, tp): rank <-> coordinates
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
    recompute: str = "none"  # activation checkpointing: none, selective or full
    zero_stage: int = 0  # ZeRO over each dp group (raylm.plan.zero)
    cpu_offload: bool = False  # zero_stage 3 on GPUs: shards and optimizer states in host memory
    # zero_stage 3: free gathered parameters after each forward (False: kept all step)
    reshard_after_forward: bool = True

    # The degrees, read from dims (the one place that knows the axes).
    dp = property(lambda self: self.dims.dp)
    pp = property(lambda self: self.dims.pp)
    tp = property(lambda self: self.dims.tp)
    world_size = property(lambda self: self.dims.world_size)

    @property
    def micro_batches_per_rank(self) -> int:
        return math.ceil(self.global_batch_size / (self.dp * self.micro_batch_size))

    @property
    def full_replica_per_rank(self) -> bool:
        """Every rank holds the whole model and optimizer state (no pipeline, no tensor
        parallelism, ZeRO stage 0): any rank's state is a live copy of all of it, so the
        group can change its data-parallel degree in memory (raylm.runtime: shrink and
        grow without a checkpoint)."""
        return self.pp == 1 and self.tp == 1 and self.zero_stage == 0

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
        if self.zero_stage > 0:
            text += f"; {describe_zero(self.zero_stage, self.dp, self.cpu_offload)}"
            if self.zero_stage == 3 and not self.reshard_after_forward:
                text += ", parameters kept gathered through each step"
        if self.recompute != "none":
            text += f"; {self.recompute} activation checkpointing"
        return text

    def resized(self, num_workers: int) -> "Plan":
        """The plan for ``num_workers`` ranks, same global batch (elastic re-plan)."""
        try:
            return dataclasses.replace(self, dims=self.dims.resized(num_workers))
        except ValueError as e:
            raise ConfigError(str(e)) from None


def describe_zero(stage: int, dp: int, cpu_offload: bool = False) -> str:
    """"ZeRO-2 (optimizer states and gradients partitioned over dp=4)"."""
    names = {"optimizer": "optimizer states", "gradients": "gradients",
             "parameters": "parameters"}
    parts = [names[p] for p in STAGE_PARTITIONS[stage]]
    what = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    text = f"ZeRO-{stage} ({what} partitioned over dp={dp})"
    if cpu_offload:
        text += ", sharded state offloaded to host memory"
    return text


def make_plan(cfg, capacity: int, spec=None, seq_len=None, search=None,
              hw=None) -> Plan:
    """Choose the layout for a TrainConfig on a cluster that can hold ``capacity`` ranks.

    With --dp, --tp and --pp all 0 the planner (raylm.plan.planner) chooses dp x tp x pp,
    the micro-batches and the schedule for the workers, holding the global batch at
    per_device_train_batch_size x gradient_accumulation_steps x workers. ``spec`` and
    ``seq_len`` (the resolved model and block size) are resolved from ``cfg`` when not
    given; ``search``: a planner search already made for these workers; ``hw``: the
    Hardware to plan for (default: raylm.plan.hardware.hardware_for(cfg)).

    The ZeRO stage: --zero_stage (or --zero_optimization, stage 1) when given; else 0,
    unless the layout does not fit the worker memory at stage 0 and dp > 1: then the
    lowest stage (1, 2, 3) whose predicted memory fits (the planner chooses it per
    layout; for a layout the flags fix, it is evaluated here), 0 when none fits.
    Sequence parallelism and activation checkpointing alike: the flags' when given, else
    off and none unless the layout needs them to fit (the fastest setting that fits)."""
    zero = requested_zero_stage(cfg)  # before anything else: one line, no actor
    recompute = requested_recompute(cfg)
    sp = cfg.sequence_parallel  # None: the planner's
    check_layout_flags(cfg.num_workers, cfg.dp, cfg.tp, cfg.pp)
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
    searched = not (cfg.dp or cfg.tp or cfg.pp)
    reshard = requested_reshard(cfg)
    if searched:  # the planner's layout (and, when unset, ZeRO stage)
        chosen = choose_for_config(cfg, num_workers, spec, seq_len, search, hw=hw)
        if reshard is None:
            reshard = chosen.reshard_after_forward
        tp, pp, accum = chosen.tp, chosen.pp, chosen.microbatches
        schedule = chosen.schedule if pp > 1 else schedule
        if zero is None:
            zero = chosen.zero_stage if num_workers // (tp * pp) > 1 else 0
        sp, recompute = chosen.sequence_parallel, chosen.recompute
    dp = dims_for_workers(num_workers, cfg.dp, tp, pp).dp
    if (zero is None and dp > 1) or (sp is None and tp > 1) or recompute is None:
        zero, sp, recompute, planned = memory_settings(
            cfg, dp, tp, pp, spec, seq_len, hw, zero if zero is not None or dp > 1 else 0,
            sp if sp is not None or tp > 1 else False, recompute)
        reshard = planned if reshard is None else reshard
    if reshard is None:  # a layout the flags fix entirely: the planner's choice for it
        reshard = _kept_gathered_fits(cfg, dp, tp, pp, spec, seq_len, hw, zero, sp,
                                      recompute)
    return Plan(dims=ParallelDims(dp=dp, pp=pp, tp=tp),
                micro_batch_size=cfg.per_device_train_batch_size,
                global_batch_size=cfg.per_device_train_batch_size * accum * dp,
                cpus_per_worker=cfg.cpus_per_worker, use_gpu=cfg.use_gpu,
                schedule=schedule,
                sequence_parallel=bool(sp and tp > 1), recompute=recompute,
                zero_stage=zero or 0, cpu_offload=bool(getattr(cfg, "cpu_offload", False)),
                reshard_after_forward=reshard or (zero or 0) != 3)


def _kept_gathered_fits(cfg, dp, tp, pp, spec, seq_len, hw, zero, sp, recompute):
    """--reshard_after_forward unset on a layout the flags fix: False (keep ZeRO-3's
    parameters gathered through each step) where the planner finds that it fits
    (raylm.plan.planner._keep_gathered, which says where it applies), else True; True
    when the layout cannot be evaluated (its own errors come later)."""
    if (zero or 0) != 3:  # (nothing to gather: no evaluation needed)
        return True
    try:
        c = evaluate_layout(cfg, dp=dp, tp=tp, pp=pp, spec=spec, seq_len=seq_len, hw=hw,
                            zero_stage=3, sequence_parallel=bool(sp and tp > 1),
                            recompute=recompute)
    except (ConfigError, ValueError):
        return True
    if c is None or c.problem:
        return True
    return c.layout.reshard_after_forward


def plan_run(cfg, capacity: int, spec, seq_len: int, hw=None, search=None,
             global_batch_size: Optional[int] = None) -> tuple:
    """The layout a run uses: the one planning function. ``raylm train`` (the driver) and
    ``raylm plan`` (raylm.report.plan_report) both call it, so the plan printed is the
    plan run for the same flags. Returns (Plan, the pipeline Partition or None).

    In order: the flags (make_plan: dp x tp x pp, or the planner's choice, the batch
    geometry, the ZeRO stage), the run's global batch when resuming
    (``global_batch_size``), the tensor-parallel and ZeRO constraints, then for pp > 1
    the stage cut and the schedule's checks. Every problem is one ConfigError line, raised
    before any actor starts."""
    if cfg.pp_split and not cfg.pp:
        stages = len(parse_pp_split(cfg.pp_split)) + 1
        raise ConfigError(f"--pp_split {cfg.pp_split} cuts the model into {stages} stages: "
                          f"give --pp {stages} with it")
    plan = make_plan(cfg, capacity, spec, seq_len, search=search, hw=hw)
    if global_batch_size:
        plan = dataclasses.replace(plan, global_batch_size=int(global_batch_size))
    check_tensor_layout(spec, plan, seq_len)
    check_zero_layout(spec, plan)
    own, model_type = has_own_stages(spec.config), spec.config.model_type
    problem = (reduce_dtype_problem(getattr(cfg, "reduce_dtype", "float32"), plan.zero_stage)
               or recompute_problem(plan.recompute, plan.pp, plan.schedule, own, model_type)
               or compile_problem(getattr(cfg, "torch_compile", False), plan.pp, own,
                                  model_type, getattr(cfg, "torch_compile_scope", "blocks"),
                                  plan.tp, plan.zero_stage, plan.recompute))
    if problem:
        raise ConfigError(problem)
    if plan.pp == 1:
        return plan, None
    return plan_pipeline(cfg, spec, plan, seq_len)


def memory_settings(cfg, dp: int, tp: int, pp: int, spec=None, seq_len=None, hw=None,
                    zero=None, sp=None, recompute=None) -> tuple:
    """For a layout the flags fix: (ZeRO stage, sequence parallelism, activation
    checkpointing, ZeRO-3's reshard_after_forward), those given as they are and those
    left None as the planner would set them for it (raylm.plan.planner.evaluate_layout:
    nothing it does not need to fit the worker memory); when the layout fits at no
    setting, or cannot be evaluated, the least machinery (the layout's own errors, or
    the run, tell what does not fit)."""
    least = (zero or 0, bool(sp), recompute or "none", True)
    try:
        c = evaluate_layout(cfg, dp=dp, tp=tp, pp=pp, spec=spec, seq_len=seq_len, hw=hw,
                            zero_stage=zero, sequence_parallel=sp, recompute=recompute)
    except (ConfigError, ValueError):
        return least  # a layout or model the checks after planning explain
    if c is None or c.problem or not c.fits:
        return least
    return (c.layout.zero_stage, c.layout.sequence_parallel, c.layout.recompute,
            c.layout.reshard_after_forward)


def plan_pipeline(cfg, spec, plan: Plan, seq_len: int):
    """For pp > 1: cut the model into stages and check the schedule (driver side, no
    weights: the model is built on the meta device). Returns (plan, Partition)."""
    schedule = plan.schedule  # the user's --pipeline_schedule, or the planner's choice
    virtual = virtual_stages(schedule, cfg.pp_virtual_stages)
    check_schedule(schedule, plan.pp, virtual, plan.micro_batches_per_rank)
    split = parse_pp_split(cfg.pp_split)
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
    if plan.tp <= 1:
        return
    check_tensor_parallel(spec.config, plan.tp, plan.sequence_parallel)
    if plan.sequence_parallel and getattr(spec, "lora", None) is not None:
        raise ConfigError(f"--sequence_parallel: {LORA_SP}")
    problem = (sequence_parallel_problem(plan.tp, plan.pp, plan.sequence_parallel, seq_len)
               or tensor_pipeline_problem(plan.tp, plan.pp, has_own_stages(spec.config),
                                          spec.config.model_type, layers_only(spec.config)))
    if problem:
        raise ConfigError(problem)


def check_zero_layout(spec, plan: Plan) -> None:
    """A ZeRO stage the layout cannot run with (raylm.plan.zero.unsupported): one clear
    error before any actor."""
    problem = unsupported(plan.zero_stage, plan.pp, plan.schedule,
                          has_own_stages(spec.config))
    if problem:
        raise ConfigError(problem)
