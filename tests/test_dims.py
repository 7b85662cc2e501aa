"""ParallelDims: the one place that maps global ranks to layout coordinates and back.

Its arithmetic must agree with the DeviceMesh the ranks build (torch lays a mesh of shape
``dims.shape`` out as ``arange(world).reshape(shape)``), with placement (a tensor-parallel
group is one bundle on one node) and with the dropout seeding the runtime relied on.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from raylm.errors import ConfigError
from raylm.plan.dims import AXES, ParallelDims

SHAPES = [(1, 1, 1), (4, 1, 1), (1, 2, 2), (2, 2, 2), (3, 2, 4), (2, 4, 1)]


@pytest.mark.parametrize("dp,pp,tp", SHAPES)
def test_coordinates_are_the_device_mesh_layout(dp, pp, tp):
    dims = ParallelDims(dp=dp, pp=pp, tp=tp)
    grid = torch.arange(dims.world_size).reshape(dims.shape)  # how DeviceMesh lays ranks out
    assert dims.shape == (dp, pp, tp) and AXES == ("dp", "pp", "tp")
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        rank = int(grid[d, p, t])
        assert dims.rank(dp=d, pp=p, tp=t) == rank
        assert dims.coords(rank) == {"dp": d, "pp": p, "tp": t}
        # the groups a rank's mesh["dp"], mesh["tp"], ... would give it
        assert dims.group(rank, "dp") == grid[:, p, t].tolist()
        assert dims.group(rank, "pp") == grid[d, :, t].tolist()
        assert dims.group(rank, "tp") == grid[d, p, :].tolist()
        assert dims.group(rank, ("pp", "tp")) == grid[d].reshape(-1).tolist()
        # what the driver and the worker computed by hand before
        assert dims.index(rank, "dp") == rank // (pp * tp) == d
        assert dims.node_group(rank) == rank // tp  # placement bundle: a whole tp group
        assert dims.seed_index(rank) == rank // tp  # tp peers share a dropout seed


def test_sizes_and_resizing():
    dims = ParallelDims(dp=4, pp=2, tp=2)
    assert dims.world_size == 16 and dims.replica_size == 4 and dims.node_group_size == 2
    assert dims.size(("dp", "tp")) == 8 and dims.to_dict() == {"dp": 4, "pp": 2, "tp": 2}
    assert dims.resized(11) == ParallelDims(dp=2, pp=2, tp=2)  # whole replicas only
    with pytest.raises(ValueError, match="cannot hold one pp=2 x tp=2 replica"):
        dims.resized(3)


def test_bad_coordinates_are_errors():
    dims = ParallelDims(dp=2, pp=1, tp=2)
    with pytest.raises(ValueError, match="rank 4 outside a world of 4"):
        dims.coords(4)
    with pytest.raises(ValueError, match="tp=2 outside 0..1"):
        dims.rank(tp=2)
    with pytest.raises(ValueError, match="unknown axes"):
        dims.group(0, "cp")
    with pytest.raises(ValueError, match="every degree must be >= 1"):
        ParallelDims(dp=0)


def test_plan_reads_its_degrees_from_dims():
    from raylm.plan.layout import Plan

    plan = Plan(dims=ParallelDims(dp=2, pp=2, tp=1), micro_batch_size=2, global_batch_size=8,
                cpus_per_worker=0.5)
    assert (plan.dp, plan.pp, plan.tp, plan.world_size) == (2, 2, 1, 4)
    assert plan.micro_batches_per_rank == 2
    smaller = plan.resized(2)
    assert smaller.dims == ParallelDims(dp=1, pp=2, tp=1) and smaller.global_batch_size == 8
    with pytest.raises(ConfigError, match="cannot hold one pp=2 x tp=1 replica"):
        plan.resized(1)
