"""ZeRO over the data-parallel groups (Rajbhandari et al. 2020).

* stage 1 and 2: raylm.parallel.zero.partitioned (raylm's partitioned AdamW and
  reduce-scatter of gradients into each rank's rows);
* stage 3: raylm.parallel.zero.fsdp (torch's FSDP2).

Which rows a rank owns: raylm.plan.zero.
"""

from raylm.parallel.data import GradientAllReduce, GradientSync
from raylm.parallel.zero.fsdp import FSDPGradients
from raylm.parallel.zero.partitioned import ReduceScatterGradients, ShardedGradients


def gradient_sync(stage: int, model, dp_group, reduce_dtype=None,
                  keep_gathered: bool = False, overlap: bool = False,
                  gloo: bool = False) -> GradientSync:
    """The gradient sync of a ZeRO stage over ``dp_group``: 0 all-reduces full gradients
    (in ``reduce_dtype`` when given: bf16 on the wire), 1 reduce-scatters them once per
    step, 2 after every micro-batch into partitions, 3 is FSDP's (the model must be
    sharded with apply_fsdp already, whose policy holds its reduce dtype;
    ``keep_gathered``: its parameters stay gathered, and its gradients unsharded, through a
    step's micro-batches; ``gloo``: a CPU group, whose reduce-scatters raylm does itself,
    and ``overlap``: in the background, where FSDP2 has no streams to do that;
    FSDPGradients says when it is right)."""
    if stage == 3:
        return FSDPGradients(model, dp_group, keep_gathered, overlap, gloo)
    params = list(model.parameters())
    if stage == 0:
        return GradientAllReduce(params, dp_group, reduce_dtype=reduce_dtype)
    if reduce_dtype is not None:
        raise ValueError("ZeRO 1/2 reduce-scatter fp32 gradients only")
    kind = {1: ReduceScatterGradients, 2: ShardedGradients}[stage]
    return kind(params, dp_group)
