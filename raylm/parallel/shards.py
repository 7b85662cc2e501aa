"""Moving a tensor between its pieces across ranks: helpers the tensor-parallel checkpoint
form (raylm.parallel.tensor.canonical), ZeRO (raylm.parallel.zero) and checkpoints
(raylm.checkpoint.state) share.

Under ZeRO-3 with tensor parallelism a parameter is a DTensor over (dp, tp): each rank
holds its FSDP rows of its tensor-parallel shard. ``tp_shard_of`` gathers it over dp into
the tp shard (what the canonical form speaks), ``write_rows_back`` returns a tp shard's
rows to the rank.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from raylm.plan.zero import owned_rows


def contiguous_stride(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (a DTensor's global stride)."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def tp_shard_of(value):
    """A ZeRO-3 tensor under tensor parallelism (a DTensor over (dp, tp): each rank holds
    its FSDP rows of its tensor-parallel shard) as the tensor-parallel DTensor alone (on
    the tp mesh, the rank's whole tp shard): gathered over dp, a transient copy. (A tp
    shard split on dim 0 is FSDP's ``_StridedShard`` over dp; redistribute handles it.)"""
    mesh = value.device_mesh
    tp_mesh, pl = mesh[mesh.mesh_dim_names[-1]], value.placements[-1]
    whole = value.redistribute(placements=[Replicate()] * (mesh.ndim - 1) + [pl])
    return DTensor.from_local(whole.to_local(), tp_mesh, [pl], shape=value.shape,
                              stride=value.stride(), run_check=False)


@torch.no_grad()
def write_rows_back(value, whole) -> None:
    """The inverse of ``tp_shard_of``: copy this rank's dp rows of ``whole`` (the rank's
    tp shard as loaded, a DTensor on the tp mesh, or a plain tensor of the rows) into
    ``value``'s local tensor (the rows split over dp as torch.chunk splits them, as FSDP
    and Shard(0) do: raylm.plan.zero.owned_rows; a local slice, no communication)."""
    mesh = value.device_mesh
    full = whole.to_local() if isinstance(whole, DTensor) else whole
    a, b = owned_rows(full.shape[0], mesh.size(0), mesh.get_local_rank(0))
    local = value.to_local()
    local.copy_(full[a:b].reshape_as(local))
