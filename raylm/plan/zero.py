"""ZeRO partitions: which data-parallel rank owns which part of each tensor.

Under ZeRO stage s >= 1 each data-parallel group splits every tensor of its replica
(optimizer states from stage 1, gradients from 2, parameters at 3) into dp parts. raylm
splits each tensor along its first dimension, the way torch's DTensor ``Shard(0)`` and
FSDP2 split it (``torch.chunk``: ceil(n / dp) rows per rank, the last ranks shorter or
empty), so that

* every rank owns 1/dp of every tensor (to one row): per-rank state is within rounding of
  the ZeRO paper's formulas, however unequal the tensors (an embedding that is a third of
  the model is split like the rest; torch's ZeroRedundancyOptimizer assigns whole
  tensors to ranks, which can leave one rank a quarter over its share);
* stage 1/2 (raylm's own partitioned optimizer) and stage 3 (FSDP2) own the same rows, and
  a partition is a DTensor shard, which torch.distributed.checkpoint reshards into any
  other layout.

The driver's Plan names the stage; this module says what that means per rank.
"""

from __future__ import annotations

import math
from typing import Optional

from raylm.errors import ConfigError

ZERO_STAGES = (0, 1, 2, 3)

# What each stage partitions across the data-parallel group.
STAGE_PARTITIONS = {
    0: (),
    1: ("optimizer",),
    2: ("optimizer", "gradients"),
    3: ("optimizer", "gradients", "parameters"),
}


def owned_rows(rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a tensor with ``rows`` rows (its first dimension) that
    data-parallel rank ``dp_rank`` of ``dp`` owns: torch.chunk's split, as DTensor
    Shard(0) and FSDP2 take it."""
    if dp <= 1:
        return 0, rows
    per = math.ceil(rows / dp) if rows else 0
    start = min(dp_rank * per, rows)
    return start, min(start + per, rows)


def owned_numel(shape, dp: int, dp_rank: int) -> int:
    """Elements of a tensor of ``shape`` that ``dp_rank`` owns (a 0-d tensor is one row)."""
    shape = tuple(int(n) for n in shape) or (1,)
    start, stop = owned_rows(shape[0], dp, dp_rank)
    return (stop - start) * math.prod(shape[1:])


def owned_partition(shapes: dict, dp: int, dp_rank: int) -> tuple[dict, int]:
    """What data-parallel rank ``dp_rank`` of ``dp`` owns of the tensors ``shapes``
    ({name: shape}, one replica's: one pipeline stage's tensor-parallel shard): the rows
    {name: (start, stop)} of each and their element count (a 0-d tensor is one row)."""
    rows = {name: owned_rows((tuple(s) or (1,))[0], dp, dp_rank) for name, s in shapes.items()}
    return rows, sum(owned_numel(s, dp, dp_rank) for s in shapes.values())


def theory_bytes(elements: int, stage: int, dp: int, param_bytes: int = 4,
                 optimizer_bytes_per_param: int = 8, trainable=None) -> dict:
    """The ZeRO paper's per-rank model-state bytes (Rajbhandari et al. 2020, section 5)
    for a replica of ``elements`` parameters: fp32 parameters and gradients (4 bytes
    each) and AdamW's two moments (K = 8 bytes per parameter), each divided by dp once
    its stage partitions it. ``trainable``: of the elements, those trained (default:
    all); frozen ones have no gradient and no optimizer state."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage {stage}: choose one of {ZERO_STAGES}")
    parts = STAGE_PARTITIONS[stage]
    n = max(1, dp)
    trained = elements if trainable is None else trainable
    return {
        "parameters": elements * param_bytes / (n if "parameters" in parts else 1),
        "gradients": trained * param_bytes / (n if "gradients" in parts else 1),
        "optimizer": trained * optimizer_bytes_per_param / (n if "optimizer" in parts else 1),
    }


def unsupported(stage: int, pp: int, schedule: str, own_stages: bool = True):
    """Why ``stage`` cannot run with this pipeline (a sentence), or None. ZeRO-3 runs
    with pipelines cut by raylm's own stages (the model families, T5) under every
    schedule but zero_bubble:

    * torch's zero-bubble (V) schedule over FSDP2 stage modules (its split
      weight-gradient pass against FSDP's reduce-scatter) trained off the
      single-process losses here;
    * stage modules from the generic torch.export split (``own_stages=False``) are
      modules of their own, outside the meta-built model that is materialised, and
      tied weights among them do not checkpoint under FSDP yet."""
    if stage == 3 and pp > 1 and schedule == "zero_bubble":
        return ("--zero_stage 3 with --pipeline_schedule zero_bubble is not supported yet: "
                "use gpipe, 1f1b or interleaved_1f1b, or a lower --zero_stage")
    if stage == 3 and pp > 1 and not own_stages:
        return ("--zero_stage 3 with --pp > 1 needs a model raylm has stages for (a model "
                "family or T5); this one is cut by the generic torch.export split, which "
                "ZeRO-3 does not take yet: use --zero_stage 2 or lower, or --pp 1")
    return None


def requested_reshard(cfg) -> Optional[bool]:
    """--reshard_after_forward as given; unset: None (the planner keeps ZeRO-3's
    parameters gathered through a step where that fits), or True under --cpu_offload
    (whose point is memory)."""
    flag = getattr(cfg, "reshard_after_forward", None)
    if flag is None and getattr(cfg, "cpu_offload", False):
        return True
    return flag


def requested_zero_stage(cfg) -> Optional[int]:
    """The ZeRO stage the flags ask for (None: unset, the planner's choice), after the
    checks that need no model: --zero_optimization True is --zero_stage 1; --cpu_offload
    needs --use_gpu and stage 3. One-line ConfigError otherwise."""
    stage = getattr(cfg, "zero_stage", None)
    if stage is not None and (isinstance(stage, bool) or stage not in ZERO_STAGES):
        raise ConfigError(f"--zero_stage {stage}: choose one of 0, 1, 2, 3")
    if getattr(cfg, "zero_optimization", False):
        if stage is not None and stage != 1:
            raise ConfigError(f"--zero_optimization True means --zero_stage 1, which "
                              f"conflicts with --zero_stage {stage}: give one of the two")
        stage = 1
    if getattr(cfg, "cpu_offload", False):
        if not cfg.use_gpu:
            raise ConfigError("--cpu_offload needs --use_gpu: on CPU workers the optimizer "
                              "states are in host memory already")
        if stage != 3:
            got = "is unset" if stage is None else f"is {stage}"
            raise ConfigError(f"--cpu_offload needs --zero_stage 3 (FSDP2's CPU offload of "
                              f"the sharded parameters, gradients and optimizer states; "
                              f"stages 1 and 2 do not offload yet; --zero_stage {got})")
    if requested_reshard(cfg) is False and stage != 3:
        got = "unset" if stage is None else str(stage)
        raise ConfigError(f"--reshard_after_forward False needs --zero_stage 3 (it is FSDP2's "
                          f"choice of when to free gathered parameters; --zero_stage is "
                          f"{got})")
    return stage
