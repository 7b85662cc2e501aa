"""Layout constraints, each written once: a function that returns the problem, "" when
there is none. The planner shows a problem as the reason a layout cannot run
(raylm.plan.planner); ``plan_run`` raises it as the one-line error before any actor
starts (raylm.plan.layout). ZeRO's are in raylm.plan.zero (``unsupported``), a model's
tensor-parallel limits with its plans (raylm.models.tensor_plans.check_tensor_parallel),
a schedule's in raylm.plan.partition (``check_schedule``).
"""

from __future__ import annotations


def sequence_parallel_problem(tp: int, pp: int, sequence_parallel: bool,
                              seq_len: int) -> str:
    """Sequence parallelism cuts each block's input into tp equal slices of the
    sequence; pipeline stages exchange whole sequences."""
    if not sequence_parallel or tp <= 1:
        return ""
    if pp > 1:
        return ("--sequence_parallel with --pp > 1 is not supported yet: stages exchange "
                "whole sequences; drop one of the two")
    if seq_len % tp:
        return (f"--sequence_parallel with --tp {tp}: the block size {seq_len} must be a "
                "multiple of tp (each rank holds an equal slice of the sequence)")
    return ""


def tensor_pipeline_problem(tp: int, pp: int, own_stages: bool, model_type: str,
                            layers_only: bool) -> str:
    """Tensor parallelism inside pipeline stages: raylm's own stage modules (a family, T5)
    run the model's layers, sharded as without a pipeline; the generic split traces the
    model whole with torch.export, and its graphs take a plan of layers only
    (``layers_only``, raylm.models.tensor_plans.Plan.vocabulary False: a model of your
    own's, a torchvision classifier's, ViT's; raylm.parallel.tensor.stage_graphs), not a
    language model's plan, which also pads the vocabulary and re-ties weights."""
    if tp <= 1 or pp <= 1 or own_stages or layers_only:
        return ""
    return (f"--tp {tp} with --pp {pp}: raylm cuts '{model_type}' into stages by tracing it "
            "with torch.export, whose graphs take a plan of layers only (a model of your "
            "own's, train(..., model_init=, tp_plan=); an image classifier's), not a "
            "language model's; use one of the two, or a model type raylm has stages for")


def recompute_problem(recompute: str, pp: int, schedule: str, own_stages: bool,
                      model_type: str) -> str:
    """Activation checkpointing wraps the blocks' forward: the generic pipeline split
    traces the model with torch.export into graphs that have no blocks left to wrap; and
    the zero-bubble schedule runs each stage's backward in two passes (inputs, then
    weights), which torch's selective checkpointing refuses (its cache of saved outputs
    is used up by the first)."""
    if recompute in (None, "none") or pp <= 1:
        return ""
    if not own_stages:
        return (f"activation checkpointing with --pp {pp}: raylm cuts '{model_type}' into "
                "stages by tracing it with torch.export, whose graphs have no blocks to "
                "checkpoint; use one of the two, or a model type raylm has stages for")
    if recompute == "selective" and schedule == "zero_bubble":
        return ("--activation_checkpointing selective with --pipeline_schedule zero_bubble: "
                "the schedule's split backward runs each block's backward twice, which "
                "selective checkpointing cannot; use full, or another schedule")
    return ""


def compile_problem(compile: bool, pp: int, own_stages: bool, model_type: str,
                    scope: str = "blocks", tp: int = 1, zero_stage: int = 0,
                    recompute: str = "none") -> str:
    """--torch_compile compiles each block's forward (raylm.parallel.compile): the generic
    pipeline split traces the model with torch.export into graphs with no blocks left.
    --torch_compile_scope model compiles the rank's whole forward, which needs the whole
    model on the rank with nothing wrapping its blocks."""
    if not compile:
        return ""
    if scope == "model":
        wrapped = [f for f, on in (
            (f"--pp {pp}", pp > 1), (f"--tp {tp}", tp > 1),
            ("ZeRO-3", zero_stage == 3),
            (f"--activation_checkpointing {recompute}", recompute != "none")) if on]
        if wrapped:
            return ("--torch_compile_scope model compiles the rank's whole forward, and "
                    f"this layout has {', '.join(wrapped)} (the rank holds a part of the "
                    "model, or its blocks are wrapped); use --torch_compile_scope blocks")
    if pp <= 1 or own_stages:
        return ""
    return (f"--torch_compile with --pp {pp}: raylm cuts '{model_type}' into stages by "
            "tracing it with torch.export, whose graphs have no blocks to compile; use one "
            "of the two, or a model type raylm has stages for")


def reduce_dtype_problem(reduce_dtype: str, zero_stage: int) -> str:
    """Gradients summed in bf16 (--reduce_dtype): ZeRO-0's all-reduce and ZeRO-3's
    FSDP2 reduce-scatter take it; ZeRO 1 and 2's own reduce-scatter is fp32 only."""
    if reduce_dtype == "float32" or zero_stage not in (1, 2):
        return ""
    return (f"--reduce_dtype {reduce_dtype}: this layout runs ZeRO-{zero_stage}, whose "
            "reduce-scatter is fp32 only (not built in bf16 yet); give --zero_stage 0 or 3, "
            "or --reduce_dtype float32")
