"""The layout's named axes: how many ranks along each parallel dimension, and the one
place that turns a global rank into coordinates and back.

Axes are in mesh order, outermost first: data parallel (dp), pipeline (pp), tensor
parallel (tp). tp is innermost, so a tensor-parallel group is a run of adjacent ranks,
which placement keeps on one node (``NODE_LOCAL``). A new axis (context parallelism,
expert parallelism) is one more name in ``AXES`` with its degree: the rank arithmetic
below, the mesh (raylm.parallel.mesh) and the placement derive from them.

The driver, the planner, the cost model, the worker and placement ask this object; no
other module computes ``rank // tp`` or a mesh shape. Pure: no torch.distributed (the
DeviceMesh is built from it by raylm.parallel.mesh).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from raylm.errors import ConfigError

AXES = ("dp", "pp", "tp")
# Axes whose groups must sit on one node (their collectives run every layer).
NODE_LOCAL = ("tp",)
# Axes whose peers compute the same (replicated) activations: they share a dropout seed.
SAME_ACTIVATIONS = ("tp",)


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis}={getattr(self, axis)}: every degree must be >= 1")

    # -- sizes -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        """Degrees in mesh order (the DeviceMesh's shape)."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, axes) -> int:
        """Ranks spanned by ``axes`` (a name or names) with the other coordinates fixed."""
        return math.prod(getattr(self, a) for a in _names(axes))

    def to_dict(self) -> dict:
        return {a: getattr(self, a) for a in AXES}

    # -- ranks and coordinates -------------------------------------------------------------
    def coords(self, rank: int) -> dict:
        """{axis: index} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        out = {}
        for axis in reversed(AXES):
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return {a: out[a] for a in AXES}

    def rank(self, **coords) -> int:
        """The global rank at ``coords`` (an axis left out is 0)."""
        rank = 0
        for axis in AXES:
            index = coords.get(axis, 0)
            if not 0 <= index < getattr(self, axis):
                raise ValueError(f"{axis}={index} outside 0..{getattr(self, axis) - 1}")
            rank = rank * getattr(self, axis) + index
        return rank

    def index(self, rank: int, axes) -> int:
        """The flat index of ``rank``'s coordinates on ``axes`` (in mesh order): e.g. its
        data-parallel replica for "dp", or for ("dp", "pp") which tensor-parallel group
        it is in."""
        c, index = self.coords(rank), 0
        for axis in AXES:
            if axis in _names(axes):
                index = index * getattr(self, axis) + c[axis]
        return index

    def group(self, rank: int, axes) -> list:
        """The global ranks that share every coordinate of ``rank`` but those on
        ``axes`` (its dp group, its tp group, ...), in mesh order."""
        c, names = self.coords(rank), _names(axes)
        free = [a for a in AXES if a in names]
        out = []
        for flat in range(self.size(free)):
            pos = dict(c)
            for axis in reversed(free):
                flat, pos[axis] = divmod(flat, getattr(self, axis))
            out.append(self.rank(**pos))
        return out

    # -- placement -------------------------------------------------------------------------
    @property
    def node_group_size(self) -> int:
        """Ranks that must be placed on one node together (a tensor-parallel group)."""
        return self.size(NODE_LOCAL)

    def node_group(self, rank: int) -> int:
        """The placement bundle of ``rank``: one bundle (on one node) per node-local
        group."""
        return self.index(rank, [a for a in AXES if a not in NODE_LOCAL])

    def seed_index(self, rank: int) -> int:
        """Which random stream a rank's dropout draws from: one per group of peers that
        compute the same activations (tensor-parallel peers share one)."""
        return self.index(rank, [a for a in AXES if a not in SAME_ACTIVATIONS])

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica (the model-parallel axes)."""
        return self.world_size // self.dp

    # -- resizing --------------------------------------------------------------------------
    def resized(self, world_size: int) -> "ParallelDims":
        """The same model-parallel shape (pp x tp) on ``world_size`` ranks: dp changes.
        ValueError when not one replica fits."""
        replica = self.replica_size
        if world_size < replica:
            raise ValueError(f"{world_size} worker(s) cannot hold one pp={self.pp} x "
                             f"tp={self.tp} replica")
        return dataclasses.replace(self, dp=world_size // replica)

    def describe(self) -> str:
        return " x ".join(f"{a}={getattr(self, a)}" for a in AXES)


def check_layout_flags(num_workers: int, dp: int, tp: int, pp: int) -> None:
    """The flags' own layout (0: unset), before any cluster is asked: the degrees are not
    negative and, where --num_workers is given with any of them, they make it."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("num_workers", num_workers)):
        if value < 0:
            raise ConfigError(f"--{name} must be >= 0")
    if num_workers and (dp or tp or pp):
        dims_for_workers(num_workers, dp, tp or 1, pp or 1)


def dims_for_workers(num_workers: int, dp: int, tp: int, pp: int) -> ParallelDims:
    """The layout of ``num_workers`` ranks in pp x tp replicas (``dp`` 0: as many as fit);
    ConfigError, naming the flags, when they cannot make it."""
    replica = tp * pp
    if num_workers < replica:
        raise ConfigError(f"--num_workers {num_workers} cannot hold one pp={pp} x tp={tp} "
                          f"replica: give at least {replica} workers, or lower --tp or --pp")
    dims = ParallelDims(dp=dp or num_workers // replica, pp=pp, tp=tp)
    if dims.world_size != num_workers:
        fix = ("drop --dp or change it" if dp else
               f"use a multiple of pp x tp = {replica} workers")
        raise ConfigError(f"dp={dims.dp} x tp={tp} x pp={pp} = {dims.world_size} does not "
                          f"equal --num_workers {num_workers}: {fix}")
    return dims


def _names(axes) -> tuple:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = set(names) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)} (axes: {', '.join(AXES)})")
    return names
