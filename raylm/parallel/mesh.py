"""The DeviceMesh of a layout, and which of its axes a tensor is sharded on.

The mesh has one named dimension per axis of ``raylm.plan.dims.AXES`` (dp, pp, tp), in
that order, so ``mesh["tp"]`` is a rank's tensor-parallel group, ``mesh["dp"]`` its
data-parallel group, and so on for any axis added there.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from raylm.plan.dims import AXES, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str):
    """The world's DeviceMesh for ``dims`` (collective over every rank: call it on each,
    in the same order, after init_process_group)."""
    return init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)


def sharded_axes(tensor) -> dict:
    """{axis name: ranks along it} for each mesh axis a DTensor is split on (a plain
    tensor: none). FSDP's _StridedShard counts as split (its ``is_shard()`` is False, but
    it is neither Replicate nor Partial)."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return {}
    names = mesh.mesh_dim_names or ()
    return {names[d]: mesh.size(d) for d, pl in enumerate(tensor.placements)
            if d < len(names) and not (pl.is_replicate() or pl.is_partial())}
