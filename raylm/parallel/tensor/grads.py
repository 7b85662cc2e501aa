"""The squared global gradient norm when some gradients are tensor-parallel shards.

torch's ``clip_grad_norm_`` over DTensor gradients computes the norm with DTensor ops and
one collective per gradient; this sums the local squares first and does one all-reduce
per mesh group. Each tensor's norm is taken in its own dtype, as torch's
``clip_grad_norm_`` does (so a model that is not sharded gets torch's figure to the last
bits, which matters: Adam turns a last-bit change of the clip coefficient into visible
changes of weights whose gradients are near zero), and summed in float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def reduce_partial(g: DTensor) -> DTensor:
    """A DTensor gradient with its Partial mesh dims summed (Replicate there): torch
    leaves one when a replicated parameter meets sharded activations and no gradient
    was pre-allocated."""
    if any(pl.is_partial() for pl in g.placements):
        g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                       for pl in g.placements])
    return g


def grad_norm_sq(params) -> torch.Tensor:
    """Sum of squares of the gradients of ``params`` over the whole (tensor-parallel) model,
    as one process holding the full tensors would compute it; a float64 scalar tensor.

    * A DTensor gradient sharded over mesh dims (tensor parallelism, and ZeRO-3's dp
      rows) contributes its local shard, summed over those dims' process groups.
    * A replicated gradient (plain tensor, or Replicate DTensor) counts once: every tp rank
      holds the same values, so each adds it locally and nothing is summed.
    * A Partial gradient (torch leaves one when a replicated parameter meets sharded
      activations and no gradient was pre-allocated) is reduced first.

    Collective over the tp group(s) of the sharded gradients: all ranks of a group call it
    with the same parameters in the same order. Pipeline stages add theirs over the pp
    group themselves (sum of squares is additive).
    """
    total = torch.zeros((), dtype=torch.float64)
    sharded: dict = {}  # (mesh, sharded mesh dims) -> local squared sum
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = reduce_partial(g)
            local = g.to_local().detach()
            sq = torch.linalg.vector_norm(local, 2.0).double() ** 2
            # Sharded dims: Shard, and FSDP's _StridedShard (ZeRO-3 over a tp shard split
            # on the same dim), which is not a Shard (its is_shard() is False).
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            if dims:  # kept on the gradient's device (NCCL reduces device tensors)
                key = (g.device_mesh, dims)
                sharded[key] = sharded[key] + sq if key in sharded else sq
                continue
            total += sq.cpu()
        else:
            total += torch.linalg.vector_norm(g.detach(), 2.0).double().cpu() ** 2
    # In first-seen order, which is the same on every rank (same parameters, same order).
    for (mesh, dims), sq in sharded.items():
        for d in dims:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        total += sq.cpu()
    return total
