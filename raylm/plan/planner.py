"""The layout planner: every (dp, tp, pp, schedule) a cluster of N workers can run,
ranked by the cost model's predicted step time, for those that fit worker memory.

The model is built once on the meta device and read into a ModelShape; each candidate is
then arithmetic (raylm.plan.cost), so a 70B model on a thousand workers plans in about a
second. The global batch is held fixed across candidates (the samples of a step, so the
loss curve, do not depend on the layout): per_device_train_batch_size x
gradient_accumulation_steps x N sequences, i.e. what pure data parallelism over all N
workers would train; a layout with dp replicas runs N/dp times the micro-batches per
replica (micro-batches of per_device_train_batch_size sequences).

Rules: dp x tp x pp = N; tp divides the attention and key-value heads, stays inside a
node (divides the workers per node: tp groups are placed whole on nodes) and needs a
model raylm can shard; pp <= blocks (x virtual stages), on a model raylm can cut; the
schedule's constraints (partition.check_schedule).
Ranking: fitting layouts by predicted step time, ties to less memory; then layouts that
do not fit, by memory; then layouts that cannot run. Each loser carries one line saying
why it lost to the chosen layout.

ZeRO: with --zero_stage (or --zero_optimization) every layout is evaluated at that stage.
Unset, the stage is part of each layout: 0 when the layout fits at 0, else (dp > 1) the
lowest stage 1, 2, 3 whose predicted memory fits, else 0 (the layout does not fit). So
with ample memory nothing changes, and a layout that needs ZeRO competes on its
predicted step time with the others; a layout is never taken at a higher stage than it
needs (each stage adds communication or, at 3, parameter gathers; the cost model's
optimizer step is faster partitioned, which is not a reason to partition).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from raylm.errors import ConfigError, first_line
from raylm.models.loading import resolve_block_size, resolve_model
from raylm.models.tensor_plans import LORA_SP, check_tensor_parallel, layers_only
from raylm.models.units import meta_model
from raylm.plan.activations import RECOMPUTE_MODES, requested_recompute
from raylm.plan.constraints import (recompute_problem, reduce_dtype_problem,
                                    sequence_parallel_problem, tensor_pipeline_problem)
from raylm.plan.cost import Layout, Memory, StepTime, rank_memory, single_stage, step_time
from raylm.plan.dims import ParallelDims
from raylm.plan.hardware import Hardware, hardware_for
from raylm.plan.partition import check_schedule, parse_pp_split, partition, virtual_stages
from raylm.plan.shape import ModelShape, model_shape
from raylm.plan.text import human_bytes
from raylm.plan.zero import ZERO_STAGES, requested_reshard, requested_zero_stage, unsupported

FROM_CONFIG = "config"  # zero_stage argument: the stage the TrainConfig's flags ask for
log = logging.getLogger("raylm")

# Schedules the planner chooses among when --pp is left to it (zero bubble only when
# asked for: its bubble model is the roughest).
AUTO_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
SAME_TIME = 1e-9  # relative: equal predicted step times (GPipe vs 1F1B)


@dataclass
class Candidate:
    layout: Layout
    stage_bounds: tuple = ()
    memory: Optional[Memory] = None  # the pp rank that needs the most
    ranks: list = field(default_factory=list)  # Memory per pp rank
    time: Optional[StepTime] = None
    fits: bool = False
    problem: str = ""  # why this layout cannot run at all (no estimates then)
    reason: str = ""  # why it lost to the chosen layout
    # ZeRO stage chosen by the planner (the flags left it unset): the peak bytes per
    # worker of each stage it evaluated, lowest first ({} when the stage was given)
    zero_tried: dict = field(default_factory=dict)

    # shorthands
    dp = property(lambda self: self.layout.dp)
    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    schedule = property(lambda self: self.layout.schedule)
    microbatches = property(lambda self: self.layout.microbatches)
    zero_stage = property(lambda self: self.layout.zero_stage)

    def key(self) -> tuple:
        return (self.dp, self.tp, self.pp, self.schedule if self.pp > 1 else "")

    def name(self) -> str:
        text = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        if self.pp > 1:
            text += f" {self.schedule}"
        if self.zero_stage:
            text += f" ZeRO-{self.zero_stage}"
        if self.layout.sequence_parallel:
            text += " sequence-parallel"
        if self.layout.recompute != "none":
            text += f" {self.layout.recompute}-recompute"
        return text

    def least_memory(self) -> float:
        """The least peak bytes per worker this layout reaches (over the ZeRO stages the
        planner tried for it)."""
        return min([self.memory.total, *self.zero_tried.values()])

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp,
                "micro_batch_size": self.layout.micro_batch_size,
                "microbatches": self.microbatches, "schedule": self.schedule,
                "virtual": self.layout.virtual,
                "sequence_parallel": self.layout.sequence_parallel,
                "recompute": self.layout.recompute,
                "zero_stage": self.layout.zero_stage,
                "stage_bounds": [list(b) for b in self.stage_bounds],
                "fits": self.fits, "problem": self.problem or None,
                "reason": self.reason or None,
                "zero_tried": {str(k): v for k, v in self.zero_tried.items()} or None,
                "memory": self.memory.to_dict() if self.memory else None,
                "ranks": [r.to_dict() for r in self.ranks],
                "time": self.time.to_dict() if self.time else None}


@dataclass
class Search:
    chosen: Optional[Candidate]  # None: nothing fits
    alternatives: list  # every other candidate, best first, each with its reason
    num_workers: int
    global_batch: int  # sequences per step
    hardware: Hardware
    shape: ModelShape
    elapsed_s: float = 0.0

    @property
    def evaluated(self) -> int:
        return len(self.alternatives) + (self.chosen is not None)

    def smallest(self) -> Optional[Candidate]:
        """The runnable candidate needing the least memory (when nothing fits)."""
        runnable = [c for c in self.alternatives + [self.chosen]
                    if c is not None and c.memory is not None]
        return min(runnable, key=lambda c: c.least_memory(), default=None)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_layouts(shape: ModelShape, num_workers: int, hw: Hardware, *,
                   micro_batch_size: int, global_batch: int, dp: int = 0, tp: int = 0,
                   pp: int = 0, schedules: tuple = AUTO_SCHEDULES,
                   pp_virtual_stages: int = 2, pp_split: Optional[list] = None,
                   sequence_parallel: Optional[bool] = False,
                   zero_stage: Optional[int] = 0, recompute: Optional[str] = "none",
                   prefer: Optional[tuple] = None,
                   reshard_after_forward: Optional[bool] = True) -> Search:
    """Every layout of ``num_workers`` workers, ranked. ``dp``/``tp``/``pp`` nonzero fix
    that dimension. ``prefer`` = (dp, tp, pp, schedule): take that candidate as the
    chosen one whatever its rank (the user's own layout), the others ranked against it.
    ``zero_stage``: every layout at that ZeRO stage; None: per layout, the lowest stage
    that fits (see the module doc). ``sequence_parallel`` and ``recompute`` (activation
    checkpointing): every layout with that setting; None: per layout, the fastest
    setting that fits (see the module doc). ``reshard_after_forward`` (ZeRO-3's): None:
    False where it fits and no pipeline is used (_keep_gathered), else True.
    """
    t0 = time.perf_counter()
    parts: dict = {}
    cands = []
    for t in _divisors(num_workers):
        if tp and t != tp:
            continue
        for p in _divisors(num_workers // t):
            if pp and p != pp:
                continue
            d = num_workers // (t * p)
            if dp and d != dp:
                continue
            for sched in (schedules if p > 1 else schedules[:1]):
                cands.append(_candidate(shape, hw, parts, d, t, p, sched, micro_batch_size,
                                        global_batch, pp_virtual_stages, pp_split,
                                        sequence_parallel, zero_stage, recompute,
                                        reshard_after_forward))
    if not cands:
        raise ConfigError(f"no layout dp x tp x pp = {num_workers} matches dp={dp or 'any'} "
                          f"tp={tp or 'any'} pp={pp or 'any'}")

    def rank(c: Candidate):
        if c.problem:
            return (2, 0.0, 0.0)
        if not c.fits:
            return (1, c.memory.total, 0.0)
        return (0, c.time.step, c.memory.total)

    cands.sort(key=rank)
    chosen = None
    if prefer is not None:
        want = (prefer[0], prefer[1], prefer[2], prefer[3] if prefer[2] > 1 else "")
        chosen = next((c for c in cands if c.key() == want), None)
    elif cands[0].fits:
        chosen = cands[0]
    others = [c for c in cands if c is not chosen]
    for c in others:
        c.reason = _why_lost(c, chosen, hw)
    return Search(chosen=chosen, alternatives=others, num_workers=num_workers,
                  global_batch=global_batch, hardware=hw, shape=shape,
                  elapsed_s=time.perf_counter() - t0)


def _candidate(shape, hw, parts, dp, tp, pp, schedule, mbs, global_batch, pp_virtual,
               split, sp, zero, recompute, reshard_after_forward=True) -> Candidate:
    keep = reshard_after_forward is None  # ZeRO-3 keeps gathered where it fits
    virtual = virtual_stages(schedule, pp_virtual) if pp > 1 else 1
    m = global_batch // (dp * mbs)
    layout = Layout(dims=ParallelDims(dp=dp, pp=pp, tp=tp), micro_batch_size=mbs,
                    microbatches=max(1, m), schedule=schedule, virtual=virtual,
                    sequence_parallel=bool(sp) and tp > 1, zero_stage=zero or 0,
                    recompute=recompute or "none",
                    reshard_after_forward=reshard_after_forward is not False)
    c = Candidate(layout)
    if tp > 1:  # the model's own limits first: the most useful reason to show
        c.problem = _tp_problem(shape, tp, layout.sequence_parallel, parts)
    if c.problem:
        pass
    elif tp > hw.workers_per_node:
        c.problem = f"tp={tp} exceeds {hw.workers_per_node} workers per node"
    elif hw.workers_per_node % tp:  # a node's workers would not split into whole tp groups
        c.problem = f"tp={tp} does not divide the {hw.workers_per_node} workers of a node"
    if c.problem:
        return c
    sp_or_tp = (sequence_parallel_problem(tp, pp, layout.sequence_parallel, shape.seq_len)
                or tensor_pipeline_problem(tp, pp, shape.own_stages, shape.model_type,
                                           layers_only(shape.config))
                or recompute_problem(layout.recompute, pp, schedule, shape.own_stages,
                                     shape.model_type))
    if sp_or_tp:
        c.problem = sp_or_tp
    elif pp > 1 and not shape.cuttable:
        c.problem = f"pp={pp}: raylm cannot cut {shape.model_type} into stages"
    elif zero and (why := unsupported(zero, pp, schedule, shape.own_stages)):
        c.problem = why.split(": ", 1)[0]
    elif pp * virtual > shape.num_blocks:
        c.problem = (f"pp={pp}{f' x {virtual} virtual stages' if virtual > 1 else ''} "
                     f"exceeds the model's {shape.num_blocks} blocks")
    elif m < 1 or m * dp * mbs != global_batch:
        c.problem = (f"the global batch of {global_batch} sequences does not split into "
                     f"dp={dp} x micro-batches of {mbs}")
    if c.problem:
        return c
    if pp > 1:
        try:
            check_schedule(schedule, pp, virtual, m)
        except ConfigError as e:
            c.problem = f"{schedule}: {str(e).split(': ', 1)[-1]}"
            return c
    key = (pp, virtual, schedule if pp > 1 else "")
    if key not in parts:
        try:
            parts[key] = (partition(shape.embed, list(shape.blocks), shape.head, pp,
                                    schedule, virtual, split) if pp > 1
                          else single_stage(shape))
        except ConfigError as e:
            parts[key] = str(e)
    part = parts[key]
    if isinstance(part, str):
        c.problem = part
        return c
    c.stage_bounds = tuple(tuple(b) for b in part.bounds)
    # Each memory setting left to the planner (sequence parallelism, recomputation), at
    # the lowest ZeRO stage that fits when that is left to it too: the fastest that
    # fits, ties to the earlier (less machinery); else the one needing the least memory.
    best = None
    for option in memory_options(layout, shape, parts, sp, recompute):
        o = _lowest_stage(Candidate(option, c.stage_bounds), shape, part, hw, zero)
        if keep:
            o = _keep_gathered(o, shape, part, hw)
        if best is None or (o.fits and not best.fits) or (
                o.fits and o.time.step < best.time.step * (1 - SAME_TIME)) or (
                not o.fits and not best.fits and o.least_memory() < best.least_memory()):
            best = o
    return best


def memory_options(layout: Layout, shape: ModelShape, cache: dict, sp, recompute) -> list:
    """The layout under each setting the flags leave open (``sp`` and ``recompute``
    None), least machinery first: sequence parallelism (tp > 1, where the model and
    layout take it), then selective and full recomputation (where the blocks can be
    wrapped: raylm's own stages). ``cache``: the search's cache of tensor-parallel
    checks."""
    tp, pp = layout.tp, layout.pp
    sps = [layout.sequence_parallel]
    if sp is None and tp > 1 and not _tp_problem(shape, tp, True, cache) and \
            not sequence_parallel_problem(tp, pp, True, shape.seq_len):
        sps = [False, True]
    modes = [layout.recompute]
    if recompute is None:
        modes = [r for r in RECOMPUTE_MODES if not recompute_problem(
            r, pp, layout.schedule, shape.own_stages, shape.model_type)]
    return [dataclasses.replace(layout, sequence_parallel=s, recompute=r)
            for r in modes for s in sps]


def _lowest_stage(c: Candidate, shape: ModelShape, part, hw: Hardware, zero) -> Candidate:
    """``c`` estimated at its ZeRO stage; with the stage left to the planner (``zero``
    None) and dp > 1, at the lowest stage that fits (``zero_tried``: the stages tried)."""
    _estimate(c, shape, part, hw)
    if zero is None and not c.fits and c.dp > 1:  # the lowest ZeRO stage that fits
        tried = {0: c.memory.total}
        for stage in ZERO_STAGES[1:]:
            if (unsupported(stage, c.pp, c.schedule, shape.own_stages)
                    or reduce_dtype_problem(hw.reduce_dtype, stage)):
                continue
            z = Candidate(dataclasses.replace(c.layout, zero_stage=stage), c.stage_bounds)
            _estimate(z, shape, part, hw)
            tried[stage] = z.memory.total
            if z.fits:
                z.zero_tried = tried
                return z
        c.zero_tried = tried  # fits at no stage: reported at stage 0
    return c


def _keep_gathered(c: Candidate, shape: ModelShape, part, hw: Hardware) -> Candidate:
    """``c`` at ZeRO-3 with its parameters kept gathered and their gradients unsharded
    through each step (--reshard_after_forward False: one all-gather and one
    reduce-scatter per step instead of two all-gathers and a reduce-scatter per
    micro-batch, never slower in the cost model) when that still fits; ``c`` otherwise,
    and always with a pipeline (its schedule keeps them gathered through the step
    anyway, whatever the flag)."""
    if c.layout.zero_stage != 3 or c.dp < 2 or c.pp > 1 or not c.fits:
        return c
    k = Candidate(dataclasses.replace(c.layout, reshard_after_forward=False), c.stage_bounds)
    _estimate(k, shape, part, hw)
    if not k.fits:
        return c
    k.zero_tried = c.zero_tried
    return k


def _estimate(c: Candidate, shape: ModelShape, part, hw: Hardware) -> None:
    """The cost model's memory per pp rank and step time of ``c.layout``."""
    c.ranks = rank_memory(shape, part, c.layout, hw)
    c.memory = max(c.ranks, key=lambda r: r.total)
    c.fits = c.memory.total <= hw.worker_memory
    c.time = step_time(shape, part, c.layout, hw, c.ranks)


def _tp_problem(shape: ModelShape, tp: int, sp: bool, cache: dict) -> str:
    """Why tensor parallelism of degree ``tp`` cannot shard this model ("" if it can):
    the runtime's own check (raylm.models.tensor_plans) where the config is known, else
    the heads."""
    key = ("tp", tp, sp)
    if key in cache:
        return cache[key]
    problem = ""
    if sp and shape.lora:
        problem = f"tp={tp}: {LORA_SP}"
    elif shape.config is not None:
        try:
            check_tensor_parallel(shape.config, tp, sp)
        except ConfigError as e:
            problem = f"tp={tp}: {e}"
    elif not shape.tensor_parallel:
        problem = f"tp={tp}: raylm has no tensor-parallel plan for {shape.model_type}"
    elif not shape.tp_divides(tp):
        problem = (f"tp={tp} does not divide the {shape.heads} attention heads"
                   + (f" and {shape.kv_heads} key-value heads"
                      if shape.kv_heads != shape.heads else ""))
    cache[key] = problem
    return problem


TIME_PARTS = (("bubble", "pp bubble"), ("tp_comm", "tp all-reduces"),
              ("pp_comm", "pipeline sends and overhead"),
              ("dp_comm", "dp gradient all-reduce"), ("compute", "compute"),
              ("optimizer", "optimizer step"))


def _why_lost(c: Candidate, chosen: Optional[Candidate], hw: Hardware) -> str:
    if c.problem:
        return c.problem
    if not c.fits:
        zero3 = c.zero_tried.get(3)
        return (f"does not fit: {human_bytes(c.memory.total)} > "
                f"{human_bytes(hw.worker_memory)} per worker ({_largest_part(c.memory)})"
                + (f"; {human_bytes(zero3)} with ZeRO-3" if zero3 is not None else ""))
    if chosen is None or chosen.time is None:
        return f"predicted step {c.time.step:.3g} s"
    ratio = c.time.step / chosen.time.step
    if abs(ratio - 1) <= SAME_TIME:
        return (f"same predicted step time, more memory: {human_bytes(c.memory.total)} vs "
                f"{human_bytes(chosen.memory.total)} per worker")
    word = "slower" if ratio > 1 else "faster"
    # The cost that grew the most against the chosen layout (or shrank, when faster).
    sign = 1 if ratio > 1 else -1
    attr, label = max(TIME_PARTS, key=lambda p: sign * (getattr(c.time, p[0])
                                                         - getattr(chosen.time, p[0])))
    if attr == "bubble":
        detail = f"pp bubble {c.time.bubble_fraction:.0%}"
    else:
        detail = f"{label} {getattr(c.time, attr):.3g} s vs {getattr(chosen.time, attr):.3g} s"
    return f"{word}: {ratio:.2f}x predicted step time ({detail})"


def _largest_part(mem: Memory) -> str:
    parts = {"parameters": mem.parameters, "gradients": mem.gradients,
             "optimizer states": mem.optimizer, "activations": mem.activations,
             "workspace": mem.workspace}
    name = max(parts, key=parts.get)
    extra = f" of {mem.in_flight} micro-batches" if name == "activations" and \
        mem.in_flight > 1 else ""
    return f"{name}{extra} {human_bytes(parts[name])}"


# -- from a TrainConfig --------------------------------------------------------------------
def meta_shape(spec, seq_len: int, use_gpu: bool = False) -> tuple:
    """(the resolved model built on the meta device, its ModelShape); a config
    transformers refuses (heads not dividing the hidden size, ...) or one without a
    hidden size is one ConfigError line."""
    try:
        model = meta_model(spec)
        return model, model_shape(model, seq_len, use_gpu)
    except (ValueError, TypeError, AttributeError, AssertionError) as e:
        raise ConfigError(f"cannot build the model ({spec.config.model_type}) from its "
                          f"config: {first_line(e)}") from None


def shape_of(spec, seq_len: int, use_gpu: bool = False) -> ModelShape:
    """The ModelShape of a resolved model (built once, on the meta device)."""
    return meta_shape(spec, seq_len, use_gpu)[1]


def search_for_config(cfg, num_workers: int, spec=None, seq_len: Optional[int] = None,
                      hw: Optional[Hardware] = None, shape: Optional[ModelShape] = None,
                      global_batch: Optional[int] = None,
                      prefer: Optional[tuple] = None, zero_stage=FROM_CONFIG,
                      sequence_parallel=FROM_CONFIG, recompute=FROM_CONFIG) -> Search:
    """search_layouts for a TrainConfig: its model, batch, fixed dims and cost flags
    (``spec``/``seq_len`` are resolved from ``cfg`` when not given). ``zero_stage``: by
    default the stage the flags ask for (raylm.plan.layout.requested_zero_stage; unset:
    the planner's per-layout choice); an int fixes it, None leaves it to the planner.
    ``sequence_parallel`` and ``recompute`` (the activation checkpointing mode) alike:
    the flags' (unset: the planner's), a value, or None."""
    if zero_stage == FROM_CONFIG:
        zero_stage = requested_zero_stage(cfg)
    if sequence_parallel == FROM_CONFIG:
        sequence_parallel = getattr(cfg, "sequence_parallel", None)
    if recompute == FROM_CONFIG:
        recompute = requested_recompute(cfg)

    if spec is None or seq_len is None:
        spec = spec or resolve_model(cfg)
        seq_len = seq_len or resolve_block_size(cfg, spec)
    hw = hw or hardware_for(cfg)
    shape = shape or shape_of(spec, seq_len, hw.use_gpu)
    mbs = cfg.per_device_train_batch_size
    if global_batch is None:
        global_batch = mbs * cfg.gradient_accumulation_steps * num_workers
    split = parse_pp_split(cfg.pp_split) if cfg.pp else None
    schedules = (cfg.pipeline_schedule,) if cfg.pp else AUTO_SCHEDULES
    if not cfg.pp and cfg.pipeline_schedule not in schedules:
        schedules = schedules + (cfg.pipeline_schedule,)
    return search_layouts(
        shape, num_workers, hw, micro_batch_size=mbs, global_batch=global_batch,
        dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, schedules=schedules,
        pp_virtual_stages=cfg.pp_virtual_stages, pp_split=split,
        sequence_parallel=sequence_parallel, zero_stage=zero_stage, recompute=recompute,
        prefer=prefer, reshard_after_forward=requested_reshard(cfg))


def no_fit_error(search: Search) -> ConfigError:
    hw = search.hardware
    best = search.smallest()
    if best is None:
        reasons = "; ".join(sorted({c.problem for c in search.alternatives}))[:300]
        return ConfigError(f"no layout of {search.num_workers} worker(s) can run this model: "
                           f"{reasons}")
    m = best.memory
    hb = human_bytes
    zero3 = best.zero_tried.get(3)
    return ConfigError(
        f"no layout of {search.num_workers} worker(s) fits in {hb(hw.worker_memory)} per "
        f"worker: the smallest, {best.name()}, needs {hb(m.total)} (parameters "
        f"{hb(m.parameters)}, gradients {hb(m.gradients)}, optimizer {hb(m.optimizer)}, "
        f"activations {hb(m.activations)}, workspace {hb(m.workspace)}"
        + (f"; {hb(zero3)} with ZeRO-3" if zero3 is not None else "")
        + "); add workers, lower "
        "--per_device_train_batch_size or --block_size, or set --worker_memory_gb")


def summary(search: Search, top: int = 3) -> list[str]:
    """A few log lines: the choice and the runners-up."""
    c = search.chosen
    lines = [f"planner: {c.name()}, {c.microbatches} micro-batch(es) of "
             f"{c.layout.micro_batch_size} per replica; predicted {c.time.step:.3g} s/step, "
             f"{human_bytes(c.memory.total)} of {human_bytes(search.hardware.worker_memory)} "
             "per worker "
             f"({search.evaluated} layouts in {search.elapsed_s * 1000:.0f} ms)"]
    for alt in search.alternatives[:top]:
        lines.append(f"planner:   not {alt.name()}: {alt.reason}")
    return lines


def choose_for_config(cfg, num_workers: int, spec=None, seq_len: Optional[int] = None,
                      search: Optional[Search] = None,
                      hw: Optional[Hardware] = None) -> Layout:
    """The layout make_plan uses when --dp, --tp and --pp are all 0: the planner's choice
    (logged with its runners-up when this call searched: a caller that passes ``search``
    presents it itself), its ``zero_stage`` the flags' or the planner's; ConfigError when
    no layout fits; pure data parallelism at stage 0 (or the flags' stage), as before
    the planner, for a model whose shape it cannot read."""
    if search is not None and search.num_workers != num_workers:
        search = None  # made for another cluster size
    searched_here = search is None
    if search is None:
        try:
            search = search_for_config(cfg, num_workers, spec, seq_len, hw=hw)
        except ValueError as e:
            log.warning("planner: %s; data parallelism over the %d workers", e, num_workers)
            return Layout(dims=ParallelDims(dp=num_workers, pp=1, tp=1),
                          micro_batch_size=cfg.per_device_train_batch_size,
                          microbatches=cfg.gradient_accumulation_steps,
                          zero_stage=requested_zero_stage(cfg) or 0,
                          sequence_parallel=False,
                          recompute=requested_recompute(cfg) or "none")
    if search.chosen is None:
        raise no_fit_error(search)
    if searched_here:  # the choice; its runners-up at debug (`raylm plan` shows them)
        first, *rest = summary(search)
        log.info("%s", first)
        for line in rest:
            log.debug("%s", line)
    return search.chosen.layout


def evaluate_layout(cfg, dp: int, tp: int, pp: int, spec=None,
                    seq_len: Optional[int] = None, hw: Optional[Hardware] = None,
                    zero_stage=FROM_CONFIG, sequence_parallel=FROM_CONFIG,
                    recompute=FROM_CONFIG) -> Candidate:
    """The cost model's prediction for one given layout of ``cfg``'s model (its schedule,
    micro-batch size and gradient_accumulation_steps micro-batches per replica, as
    make_plan runs fixed dims): memory per pp rank and step time, or its ``problem``.
    ``zero_stage``: as search_for_config (default: the flags'; unset or None: the lowest
    stage that fits, as make_plan resolves it; pass a Plan's zero_stage to predict what
    that plan runs). ``sequence_parallel`` and ``recompute`` alike."""
    fixed = dataclasses.replace(cfg, dp=dp, tp=tp, pp=pp)
    search = search_for_config(
        fixed, dp * tp * pp, spec, seq_len, hw=hw,
        global_batch=cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * dp,
        prefer=(dp, tp, pp, cfg.pipeline_schedule), zero_stage=zero_stage,
        sequence_parallel=sequence_parallel, recompute=recompute)
    return search.chosen
