"""ZeRO stages 1 and 2: optimizer states (and gradients) partitioned over the dp group.

Written here rather than taken from torch, because neither of torch's ZeRO tools gives
these stages on raylm's layouts:

* ``ZeroRedundancyOptimizer`` assigns *whole* parameters to ranks; an embedding that is a
  third of a model leaves one rank far over its 1/dp share (the issue's bound is 5%);
* FSDP2 (``fully_shard``) always shards the parameters themselves: that is stage 3 (used
  for it, raylm.parallel.zero.fsdp), not stage 1 or 2, whose point is replicated
  parameters and no all-gather inside forward and backward.

Each dp rank owns rows [start, stop) of dim 0 of every tensor it holds (raylm.plan.zero:
torch.chunk's split, DTensor ``Shard(0)``, the rows FSDP2 would give it), so per-rank
state is 1/dp of the replica to a row, and a partition is a DTensor shard that
torch.distributed.checkpoint reshards into any layout.

* ``PartitionedOptimizer``: AdamW over *views* of the owned rows of each parameter (no
  copy of the parameters), then an all-gather per bucket puts every rank's updated rows
  into every replica.
* ``ReduceScatterGradients`` (stage 1): gradients live in full flat buckets as under
  stage 0 (``GradientAllReduce``), accumulated locally over the step's micro-batches; at
  the last micro-batch each bucket is reduce-scattered as it becomes ready, so each rank
  receives the sum of its own rows only (half an all-reduce's traffic).
* ``ShardedGradients`` (stage 2): no full gradient outlives a micro-batch. After each
  micro-batch's backward (as each bucket's gradients become ready) the bucket is
  reduce-scattered into the rank's persistent partition and the full gradients are
  freed; so a rank holds 1/dp of the gradients between micro-batches, plus the buckets in
  flight.

Reduce-scatter needs each rank's part contiguous; a bucket's owned rows are not (they
are a slice of every tensor), so each bucket is packed rank-major into a staging buffer
first (one copy, one bucket at a time), as FSDP2 does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylm.parallel.clip import reduce_partial, sharded_groups
from raylm.parallel.data import (GradientAllReduce, GradientSync, bucket_params, local_tensor,
                                 reduce_scatter_sum)
from raylm.parallel.checkpoint_form import PartitionedOptimizerForm
from raylm.plan.zero import owned_rows


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor as [rows, rest] (a 0-d tensor is one row)."""
    return t.reshape(t.shape[0] if t.ndim else 1, -1)


def _full_grad(g):
    """A gradient's local values; a Partial DTensor gradient (a replicated parameter on
    sequence shards, reduced over tp by torch when its gradient was pre-allocated) is
    summed over tp first."""
    return reduce_partial(g).to_local() if isinstance(g, DTensor) else g


class BucketLayout:
    """Rank-major packing of one bucket's tensors: section r holds rank r's owned rows of
    each tensor in order, every section the same length (the longest; zero tail)."""

    def __init__(self, shapes: list, dp: int, dp_rank: int):
        self.dp, self.dp_rank = dp, dp_rank
        self.shapes = [torch.Size(s) for s in shapes]
        self.rows = []  # per tensor: [(start, stop)] per rank
        self.row_len = []
        self.offsets = []  # per rank: per tensor offset within the section
        for s in self.shapes:
            n = s[0] if len(s) else 1
            self.rows.append([owned_rows(n, dp, r) for r in range(dp)])
            self.row_len.append(math.prod(s[1:]) if len(s) else 1)
        counts = []
        for r in range(dp):
            off, offs = 0, []
            for i in range(len(self.shapes)):
                a, b = self.rows[i][r]
                offs.append(off)
                off += (b - a) * self.row_len[i]
            self.offsets.append(offs)
            counts.append(off)
        self.section = max(counts) if counts else 0

    def own(self, i: int) -> tuple[int, int]:
        return self.rows[i][self.dp_rank]

    def own_view(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i``'s owned rows, as a view of ``t`` (its full local tensor)."""
        a, b = self.own(i)
        return (t if t.ndim else t.view(1))[a:b]

    def section_view(self, flat: torch.Tensor, r: int, i: int,
                     rank_major: bool = True) -> torch.Tensor:
        """Rank r's rows of tensor i: within a rank-major buffer ``flat``, or (with
        ``rank_major=False``) within ``flat`` holding section r alone."""
        a, b = self.rows[i][r]
        base = (r * self.section if rank_major else 0) + self.offsets[r][i]
        shape = (b - a, *self.shapes[i][1:]) if len(self.shapes[i]) else (b - a,)
        return flat[base:base + (b - a) * self.row_len[i]].view(shape)

    def pack(self, tensors: list, out: torch.Tensor) -> torch.Tensor:
        """Copy ``tensors`` (full local values; None is zeros) rank-major into ``out``."""
        out.zero_()
        for r in range(self.dp):
            for i, t in enumerate(tensors):
                if t is None:
                    continue
                a, b = self.rows[i][r]
                if b > a:
                    self.section_view(out, r, i).copy_((t if t.ndim else t.view(1))[a:b])
        return out

    def unpack(self, flat: torch.Tensor, tensors: list, skip_own: bool = True) -> None:
        """Copy every rank's rows from rank-major ``flat`` into ``tensors``."""
        for r in range(self.dp):
            if skip_own and r == self.dp_rank:
                continue
            for i, t in enumerate(tensors):
                a, b = self.rows[i][r]
                if b > a:
                    (t if t.ndim else t.view(1))[a:b].copy_(self.section_view(flat, r, i))


class _Partitioned(GradientSync):
    """What stage 1 and 2 share: buckets, their layouts, the loss sum, the owned-row
    gradient of each parameter (``shard_grad``), the partitioned optimizer and clipping
    over owned rows."""

    optimizer_wrapper = None  # the PartitionedOptimizer, once make_optimizer made it

    def grad_of(self, p: torch.Tensor):
        return self.shard_grad[id(p)]

    def norm_pieces(self, norm_params: list) -> list:
        # Owned rows: summed over dp, and over tp for the rows of a tensor-parallel shard.
        dp = (self.group,) if self.group is not None else ()
        return [(self.shard_grad[id(p)], dp + sharded_groups(p))
                for p in norm_params if id(p) in self.shard_grad]

    def scaled_grads(self) -> list:
        return [self.shard_grad[id(p)] for p in self.params]

    def make_optimizer(self, param_groups: list, **adamw):
        # AdamW over this rank's rows only; its step all-gathers the parameters.
        self.optimizer_wrapper = PartitionedOptimizer(self, param_groups, **adamw)
        return self.optimizer_wrapper.optimizer, self.optimizer_wrapper

    def checkpoint_form(self, model, dp_mesh):
        return self.optimizer_wrapper.checkpoint_form(model, dp_mesh)

    def _init_layouts(self, group):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        self.layouts = [BucketLayout([local_tensor(p).shape for p in b], self.size, self.dp_rank)
                        for b in self.buckets]
        self.loss = None

    def _reduce_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The step's loss summed over dp: after the gradients, so every rank makes its
        collectives in one order whatever its micro-batch count."""
        t = loss_sum.detach().reshape(1).to(torch.float64).clone()
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def _launch_reduce_scatter(self, i: int, grads: list):
        layout = self.layouts[i]
        dtype = self.buckets[i][0].dtype
        device = local_tensor(self.buckets[i][0]).device
        staging = layout.pack(grads, torch.empty(layout.section * self.size, dtype=dtype,
                                                 device=device))
        out = torch.empty(layout.section, dtype=dtype, device=device)
        # (staging lives until the work is done, in inflight)
        return reduce_scatter_sum(out, staging, self.group), staging, out


class ReduceScatterGradients(_Partitioned, GradientAllReduce):
    """Stage 1: full gradients accumulated locally; each rank receives its rows' sum."""

    def __init__(self, params, group, bucket_bytes: int = 4 * 2**20):
        GradientAllReduce.__init__(self, params, group, bucket_bytes, loss_slot=False)
        self._init_layouts(group)
        self.shard_grad = {}
        for i, bucket in enumerate(self.buckets):
            for j, p in enumerate(bucket):
                self.shard_grad[id(p)] = self.layouts[i].own_view(local_tensor(p.grad), j)
        self.inflight: list = []

    def arm(self, loss_sum: torch.Tensor) -> None:
        self.loss = loss_sum
        if self.size > 1:
            self.pending = [len(b) for b in self.buckets]
            self.armed = True

    def _launch(self) -> None:
        i = self.launched
        grads = [local_tensor(p.grad) for p in self.buckets[i]]
        self.inflight.append((i,) + self._launch_reduce_scatter(i, grads))
        self.launched += 1

    def finish(self) -> torch.Tensor:
        while self.launched < len(self.buckets):
            self._launch()
        for i, work, _staging, out in self.inflight:
            if work is not None:
                work.wait()
            for j, p in enumerate(self.buckets[i]):
                self.shard_grad[id(p)].copy_(
                    self.layouts[i].section_view(out, self.dp_rank, j, rank_major=False))
        self.inflight, self.launched, self.armed = [], 0, False
        return self._reduce_loss(self.loss)


class ShardedGradients(_Partitioned):
    """Stage 2: each micro-batch's gradients reduce-scattered into the owned rows.

    A bucket is sent once all its parameters have their gradient of the current round
    (one micro-batch's backward; under a pipeline, whatever the schedule has run since
    the bucket last went), in bucket order, the same on every dp rank. ``end_round``
    sends what a round left (parameters that got no gradient: zeros), so every rank
    makes the same collectives in the same order, also one that had fewer micro-batches
    in an epoch's short last step (it runs empty rounds).
    """

    MAX_INFLIGHT = 2  # buckets being reduced at once (each holds a staging buffer)

    def __init__(self, params, group, bucket_bytes: int = 4 * 2**20):
        self.params = [p for p in params if p.requires_grad]
        self.buckets = bucket_params(self.params, bucket_bytes)
        self._init_layouts(group)
        self.bucket_of = {}
        self.flats, self.shard_grad = [], {}
        for i, bucket in enumerate(self.buckets):
            layout = self.layouts[i]
            flat = torch.zeros(layout.section, dtype=bucket[0].dtype,
                               device=local_tensor(bucket[0]).device)
            for j, p in enumerate(bucket):
                self.bucket_of[id(p)] = i
                self.shard_grad[id(p)] = layout.section_view(flat, self.dp_rank, j,
                                                             rank_major=False)
            self.flats.append(flat)
        self.ready = [set() for _ in self.buckets]
        self.next = 0
        self.inflight: list = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p) -> None:
        self.ready[self.bucket_of[id(p)]].add(id(p))
        while self.next < len(self.buckets) and \
                len(self.ready[self.next]) == len(self.buckets[self.next]):
            self._send(self.next)

    def _send(self, i: int) -> None:
        bucket = self.buckets[i]
        grads = [None if p.grad is None else _full_grad(p.grad) for p in bucket]
        self.inflight.append((i,) + self._launch_reduce_scatter(i, grads))
        for p in bucket:
            p.grad = None  # the full gradient is done with: only the partition stays
        self.ready[i].clear()
        self.next = (i + 1) % len(self.buckets)
        while len(self.inflight) > self.MAX_INFLIGHT:
            self._settle(self.inflight.pop(0))

    def _settle(self, item) -> None:
        i, work, _staging, out = item
        if work is not None:
            work.wait()
        self.flats[i] += out

    def end_round(self, force: bool = False) -> None:
        """Send the buckets the current round has not sent yet. ``force``: a round even
        if none has begun (a rank with no micro-batch where others have one)."""
        if self.next == 0 and not force and not any(self.ready):
            if not any(p.grad is not None for p in self.params):
                return
        start = self.next
        for i in range(start, len(self.buckets)):
            self._send(i)
        self.next = 0

    def arm(self, loss_sum: torch.Tensor) -> None:
        self.loss = loss_sum

    def finish(self) -> torch.Tensor:
        self.end_round()
        while self.inflight:
            self._settle(self.inflight.pop(0))
        return self._reduce_loss(self.loss)

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.zero_()

    def held_gradients(self):
        return self.flats


class PartitionedOptimizer:
    """AdamW on this rank's rows of each parameter; then every replica gets all rows.

    ``optimizer`` is a plain ``torch.optim.AdamW`` whose parameters are views of the owned
    rows (so LR schedulers and state dicts work on it as usual); ``pieces[i]`` belongs to
    ``params[i]``. Call ``step()`` instead of ``optimizer.step()``.
    """

    def __init__(self, grads: _Partitioned, param_groups: list, **adamw):
        self.grads = grads
        self.params = grads.params
        index = {id(p): i for i, p in enumerate(self.params)}
        self.pieces = []
        for b, bucket in enumerate(grads.buckets):
            for j, p in enumerate(bucket):
                piece = grads.layouts[b].own_view(local_tensor(p).detach(), j)
                piece.grad = grads.shard_grad[id(p)]
                self.pieces.append((index[id(p)], piece))
        self.pieces = [piece for _, piece in sorted(self.pieces, key=lambda x: x[0])]
        self.piece_of = {id(p): self.pieces[i] for i, p in enumerate(self.params)}
        groups = []
        for g in param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [self.piece_of[id(p)] for p in g["params"]]})
        self.optimizer = torch.optim.AdamW(groups, **adamw)

    def checkpoint_form(self, model, dp_mesh) -> PartitionedOptimizerForm:
        return PartitionedOptimizerForm(self, model, dp_mesh)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        self.all_gather_parameters()

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        """Every rank's updated rows into every replica, bucket by bucket."""
        g = self.grads
        if g.size == 1:
            return
        inflight = []
        for i, bucket in enumerate(g.buckets):
            layout = g.layouts[i]
            locals_ = [local_tensor(p).detach() for p in bucket]
            full = torch.empty(layout.section * g.size, dtype=bucket[0].dtype,
                               device=locals_[0].device)
            own = full[g.dp_rank * layout.section:(g.dp_rank + 1) * layout.section]
            own.zero_()
            for j, t in enumerate(locals_):
                a, b = layout.own(j)
                if b > a:
                    layout.section_view(own, g.dp_rank, j, rank_major=False).copy_(
                        layout.own_view(t, j))
            work = dist.all_gather_single(full, own, group=g.group, async_op=True)
            inflight.append((work, full, layout, locals_))
            if len(inflight) > 2:
                _unpack_gather(*inflight.pop(0))
        for item in inflight:
            _unpack_gather(*item)


def _unpack_gather(work, full, layout, locals_):
    work.wait()
    layout.unpack(full, locals_)
